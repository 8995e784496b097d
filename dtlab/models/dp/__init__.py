"""Data-parallel strategies: DDP, ZeRO-1/2/3 and FSDP over one data-parallel group (what each file
holds: docs/architecture.md, section "Model strategies")."""

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
