"""Pipeline parallelism: the model split into stages over the mesh's ``pp`` axis, micro-batched.

``PipelineParallelModel(module, mesh, schedule="1f1b", micro_batches=8)`` splits ``module`` (an
``nn.Sequential`` or a module with ``pipeline_blocks()``, see :mod:`dtlab.models.pipeline._split`) into
``pp x stages_per_rank`` stages; rank ``r`` of the ``pp`` group runs stages ``r, r + pp, ...``.
``train_step((inputs, targets), loss_fn)`` runs one step's schedule (GPipe, 1F1B, interleaved 1F1B or
zero-bubble ZB-H1, built and dry-run as data at construction) on this rank's share of the batch and
returns the batch's mean loss on every pipeline rank. Each stage's gradients are then averaged over its
``dp`` group through the gradient reducer (DDP buckets; ``DDPOptimizer`` or ``ZeRO1Optimizer`` drive
it; compression swaps the reducer). Parameters of stages on other ranks are released (moved to the meta
device); ``self.module`` holds this rank's parameters under their names in ``module``. It is
:class:`~dtlab.models.HybridShardedModel` on a mesh without tensor parallelism: one implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.models.compose._options import ComposedOptions
from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.dp.zero1 import GradientSync

if TYPE_CHECKING:
    from typing_extensions import Unpack


class PipelineParallelModel(HybridShardedModel):
    """Stages over ``mesh["pp"]``, data parallelism over ``mesh["dp"]``.

    Args:
        module: the whole model, built alike on every rank (each stage's values come from its dp rank 0).
        mesh: a :class:`~dtlab.backends.Mesh` with a ``pp`` axis and optionally ``dp`` (a plain
            backend is taken as ``Mesh(backend, {"pp": backend.world_size})``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"`` (ZB-H1).
        micro_batches: micro-batches per step (default: the pp size); the batch must split evenly.
        split_points: block names where stages 1.. begin (default: balanced by parameter count).
        stages_per_rank: stages (chunks) per rank; > 1 only with ``"interleaved_1f1b"``.
        gradient_sync: dp averaging as for ZeRO1Model; None (default) lets the optimizer choose.
        activation_checkpointing: each stage keeps only its input and recomputes its forward in backward.
        bucket_cap_mb, reduce_dtype, broadcast_buffers: as for DDPModel (over the dp group).
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
        gradient_sync: GradientSync | None = None,
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
            gradient_sync=gradient_sync,
            **kwargs,
        )
