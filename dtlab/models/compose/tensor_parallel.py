"""Tensor parallelism (Megatron-LM's), composed with data parallelism over a mesh's ``dp`` axis.

``TensorParallelModel(module, mesh, plan)`` swaps the modules the plan names for their tensor-parallel
versions (:mod:`dtlab.models.tensor._plan`), each holding only this rank's shard of rank 0's values,
then runs DDP's bucketed gradient averaging over ``mesh["dp"]`` through the model's gradient reducer
(so compression composes). It is :class:`~dtlab.models.HybridShardedModel` on a mesh without a
pipeline: one implementation. ``DDPOptimizer`` (optimizer state whole on each dp replica) or
``ZeRO1Optimizer`` (state sharded over dp, Megatron's distributed optimizer) drives it::

    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(TransformerLM(...), mesh, plan="auto")   # the plan it declares
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=3e-4)
    loss = model.cross_entropy(model(x), y)     # vocabulary-parallel: the logits stay split
    loss.backward(); opt.step(); opt.zero_grad()

Every parameter carries its placement (``Shard(axis="tp", dim=d)`` or ``Replicate()``): the gradient
norm sums a sharded tensor over tp and counts a replicated one once, checkpoints store the shards as
boxes of the full tensors (loadable at another tp, into DDP or the plain module), and
``full_state_dict()`` is keyed like the original module's ``state_dict()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.errors import ArgumentError
from dtlab.models.compose._options import ComposedOptions
from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.dp.zero1 import GradientSync
from dtlab.models.tensor._plan import Plan

if TYPE_CHECKING:
    from typing_extensions import Unpack


class TensorParallelModel(HybridShardedModel):
    """Tensor parallelism over ``mesh["tp"]``, data parallelism (DDP buckets) over ``mesh["dp"]``.

    Args:
        module: the plain model; every rank builds it with the same structure (values come from rank 0).
        mesh: a :class:`~dtlab.backends.Mesh` with a ``tp`` axis and optionally a ``dp`` axis (a plain
            backend is taken as ``Mesh(backend, {"tp": backend.world_size})``).
        plan: ``"auto"`` (default): the plan the module declares (its ``tp_plan()`` method, Hugging
            Face's ``_tp_plan`` / ``config.base_model_tp_plan``, dtlab's recipe for GPT-2); or
            ``{"fqn-pattern": style}`` (see :mod:`dtlab.models.tensor._plan`; Hugging Face's style names
            are accepted). Checked before any communication. ``tensor_plan=`` (the name
            ``HybridShardedModel`` and the config use) is the same argument.
        gradient_sync: how gradients are averaged over dp; ``None`` (default) lets the optimizer choose
            (``DDPOptimizer``: all-reduce; ``ZeRO1Optimizer``: reduce-scatter of each rank's shard).
        bucket_cap_mb, reduce_dtype, find_unused_parameters, broadcast_buffers: as for DDPModel.
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
        gradient_sync: GradientSync | None = None,
        **kwargs: Unpack[ComposedOptions],
    ) -> None:
        if plan is not None and tensor_plan is not None:
            raise ArgumentError("TensorParallelModel: pass the plan once, as plan= or as tensor_plan=")
        chosen: Plan = plan if plan is not None else tensor_plan if tensor_plan is not None else "auto"
        super().__init__(module, mesh, "zero1", tensor_plan=chosen, gradient_sync=gradient_sync, **kwargs)
