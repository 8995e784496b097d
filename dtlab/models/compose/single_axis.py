"""Tensor parallelism and pipeline parallelism alone: :class:`HybridShardedModel` with the other
model-parallel axis of size 1 and ZeRO-1 over ``dp`` (``DDPOptimizer`` or ``ZeRO1Optimizer`` drives it;
``gradient_sync=None`` lets the optimizer choose all-reduce or reduce-scatter). A plain backend is
taken as a mesh of the class's own axis. Worked examples: docs/strategies.md, "Tensor parallelism" and
"Pipeline parallelism".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.core.plan import TpBatchCheck, TpBatchCheckWhen
from dtlab.errors import ArgumentError
from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.dp._materialize import MetaOptions
from dtlab.models.dp.ddp import BucketOptions
from dtlab.models.dp.zero1 import GradientSync
from dtlab.models.tensor._plan import Plan

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ComposedOptions", "PipelineParallelModel", "TensorParallelModel"]


class ComposedOptions(BucketOptions, MetaOptions, total=False):
    """The ``**kwargs`` of both: ZeRO-1's options over dp and the meta-device initialization
    (``init_seed``, ``param_init_fn``, as for HybridShardedModel)."""

    gradient_sync: GradientSync | None  #: None: the optimizer's choice


class TensorParallelModel(HybridShardedModel):
    """Tensor parallelism (Megatron-LM's) over ``mesh["tp"]``, ZeRO-1 over an optional ``mesh["dp"]``.

    Args:
        module: the plain model; every rank builds it with the same structure (values come from rank 0).
        mesh: a :class:`~dtlab.backends.Mesh` with a ``tp`` axis and optionally a ``dp`` axis.
        plan: ``"auto"`` (default): the plan the module declares (its ``tp_plan()`` method, Hugging
            Face's ``_tp_plan`` / ``config.base_model_tp_plan``, dtlab's recipe for GPT-2); or
            ``{"fqn-pattern": style}`` (see :mod:`dtlab.models.tensor._plan`; Hugging Face's style names
            are accepted). Checked before any communication. ``tensor_plan=`` is the same argument.
        tp_batch_check: how often the tp ranks' batches are compared (docs/strategies.md, "Every tp
            rank gets the same batch"): ``"always"`` (default), ``"first"`` (the first step),
            ``"never"``, or a :class:`~dtlab.core.plan.TpBatchCheck` (``TpBatchCheck("first", first=N)``).
        gradient_sync, bucket_cap_mb, reduce_dtype, find_unused_parameters, broadcast_buffers: as for
            ZeRO1Model.
    """

    strategy_name: ClassVar[str] = "tensor"
    mesh_axis: ClassVar[str | None] = "tp"
    mesh_axes: ClassVar[tuple[str, ...]] = ("dp", "tp")

    def __init__(
        self,
        module: nn.Module,
        mesh: MeshLike | CommunicationBackend,
        plan: Plan | None = None,
        *,
        tensor_plan: Plan | None = None,
        tp_batch_check: TpBatchCheck | TpBatchCheckWhen = "always",
        **kwargs: Unpack[ComposedOptions],
    ) -> None:
        if plan is not None and tensor_plan is not None:
            raise ArgumentError("TensorParallelModel: pass the plan once, as plan= or as tensor_plan=")
        chosen: Plan = plan if plan is not None else tensor_plan if tensor_plan is not None else "auto"
        super().__init__(module, mesh, "zero1", tensor_plan=chosen, tp_batch_check=tp_batch_check, **kwargs)


class PipelineParallelModel(HybridShardedModel):
    """Stages over ``mesh["pp"]``, ZeRO-1 over an optional ``mesh["dp"]``; always runs a schedule.

    Args:
        module: an ``nn.Sequential`` or a module with ``pipeline_blocks()`` (see
            :mod:`dtlab.models.pipeline._split`), built alike on every rank; rank ``r`` of ``pp`` runs
            stages ``r, r + pp, ...`` and releases the others' parameters to the meta device.
        mesh: a :class:`~dtlab.backends.Mesh` with a ``pp`` axis and optionally ``dp``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"`` (ZB-H1).
        micro_batches: micro-batches per step (default: the pp size); the batch must split evenly.
        split_points: block names where stages 1.. begin (default: balanced by parameter count).
        stages_per_rank: stages (chunks) per rank; > 1 only with ``"interleaved_1f1b"``.
        activation_checkpointing: each stage keeps only its input and recomputes its forward in backward.
        gradient_sync, bucket_cap_mb, reduce_dtype, broadcast_buffers: as for ZeRO1Model.
    """

    strategy_name: ClassVar[str] = "pipeline"
    mesh_axis: ClassVar[str | None] = "pp"
    mesh_axes: ClassVar[tuple[str, ...]] = ("pp", "dp")
    always_pipelined: ClassVar[bool] = True

    def __init__(
        self,
        module: nn.Module,
        mesh: MeshLike | CommunicationBackend,
        schedule: str = "1f1b",
        micro_batches: int | None = None,
        split_points: Sequence[str] | None = None,
        stages_per_rank: int = 1,
        *,
        activation_checkpointing: bool = False,
        **kwargs: Unpack[ComposedOptions],
    ) -> None:
        super().__init__(
            module,
            mesh,
            "zero1",
            schedule=schedule,
            micro_batches=micro_batches,
            split_points=split_points,
            stages_per_rank=stages_per_rank,
            activation_checkpointing=activation_checkpointing,
            **kwargs,
        )
