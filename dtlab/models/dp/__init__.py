"""Data-parallel strategies: DDP, ZeRO-1/2/3 and FSDP over one data-parallel group.

``data_parallel.py``: ``DataParallelModel``, what they share (checks, the reducer, ``no_sync``, the
end-of-backward flush, buffer broadcast) and what a composition uses them through; ``flat.py``: the flat
padded buffers (DDP buckets, ZeRO shards, FSDP units); ``ddp.py``, ``zero1.py``, ``zero2.py``:
replicated parameters; ``_sharded*.py``, ``zero3.py``, ``fsdp.py``: sharded parameters gathered on
demand; ``_materialize.py``: building a sharded model from the meta device; ``_grad_guard.py``: a
sharded gradient's stand-in.
"""

from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.ddp import DDPModel
from dtlab.models.dp.fsdp import FSDPModel, ModuleClassPolicy, SizePolicy, WrapPolicy
from dtlab.models.dp.zero1 import ZeRO1Model
from dtlab.models.dp.zero2 import ZeRO2Model
from dtlab.models.dp.zero3 import ZeRO3Model

__all__ = [
    "DDPModel",
    "DataParallelModel",
    "FSDPModel",
    "ModuleClassPolicy",
    "SizePolicy",
    "WrapPolicy",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
]
