"""The keyword options of the composition, typed: the data-parallel strategy's options it passes on
(every strategy's but ``world``, which is the mesh's backend) and, for the strategies built on it, the
meta-device initialization."""

from __future__ import annotations

from torch import nn

from dtlab.models.dp._materialize import MetaOptions
from dtlab.models.dp._sharded import GatherOptions
from dtlab.models.dp.ddp import BucketOptions
from dtlab.models.dp.fsdp import WrapPolicy
from dtlab.models.dp.zero1 import GradientSync

__all__ = ["ComposedOptions", "HybridOptions", "PlanOptions"]


class HybridOptions(BucketOptions, GatherOptions, total=False):
    """``HybridShardedModel``'s ``**kwargs``: the options of its ``data_parallel`` choice (each
    strategy refuses the ones it does not take, as it does alone)."""

    gradient_sync: GradientSync | None  #: zero1 (None: the optimizer's choice)
    persistence_threshold: int  #: zero3
    leaf_modules: tuple[type[nn.Module], ...]  #: zero3
    wrap_policy: WrapPolicy | None  #: fsdp
    reshard_after_forward: bool  #: fsdp


class PlanOptions(HybridOptions, MetaOptions, total=False):
    """``HybridShardedModel.from_plan``'s ``**kwargs``: the data-parallel strategy's options and the
    meta-device initialization (``init_seed``, ``param_init_fn``, as for HybridShardedModel)."""


class ComposedOptions(BucketOptions, MetaOptions, total=False):
    """``TensorParallelModel``'s and ``PipelineParallelModel``'s ``**kwargs``: ZeRO-1's options over dp
    and the meta-device initialization (``init_seed``, ``param_init_fn``, as for HybridShardedModel)."""
