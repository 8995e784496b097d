"""Tensor parallelism (Megatron-LM's), composed with data parallelism over a mesh's ``dp`` axis.

``TensorParallelModel(module, mesh, plan)`` swaps the modules the plan names for their tensor-parallel
versions (:mod:`dtlab.models._tensor_plan`), each holding only this rank's shard of rank 0's values,
then runs DDP's bucketed gradient averaging over ``mesh["dp"]`` through the model's gradient reducer
(so compression composes). ``DDPOptimizer`` (optimizer state whole on each dp replica) or
``ZeRO1Optimizer`` (state sharded over dp, Megatron's distributed optimizer) drives it::

    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(TransformerLM(...), mesh, plan=transformer_plan())
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=3e-4)
    loss = model.cross_entropy(model(x), y)     # vocabulary-parallel: the logits stay split
    loss.backward(); opt.step(); opt.zero_grad()

Every parameter carries its placement (``Shard(axis="tp", dim=d)`` or ``Replicate()``): the gradient
norm sums a sharded tensor over tp and counts a replicated one once, checkpoints store the shards as
boxes of the full tensors (loadable at another tp, into DDP or the plain module), and
``full_state_dict()`` is keyed like the original module's ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work
from dtlab.core.placement import Placement, Replicate, Shard, counts_in_norm, placement_of
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models._tensor_comm import gather_over_tp
from dtlab.models._tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dtlab.models._tensor_plan import (
    ColwiseParallel,
    HeadsParallel,
    Plan,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallel,
    apply_plan,
    resolve_plan,
    transformer_plan,
)
from dtlab.models.state import ShardIndex, add_placed_slice, add_slice, even_range, new_state, read_placed
from dtlab.models.zero1 import GradientSync, ZeRO1Model, gradient_sync_for

__all__ = [
    "ColumnParallelLinear",
    "ColwiseParallel",
    "HeadsParallel",
    "Plan",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "TensorParallelModel",
    "VocabParallel",
    "VocabParallelEmbedding",
    "transformer_plan",
    "vocab_parallel_cross_entropy",
]

_AXES = ("dp", "tp")


def _check_mesh(mesh: Any) -> None:
    needed = ("backend", "axis_names", "size", "coordinate", "__getitem__")
    if not all(hasattr(mesh, n) for n in needed):
        raise TypeError(
            f"TensorParallelModel needs a dtlab.backends.Mesh with a 'tp' axis, got {type(mesh).__name__}; "
            "build one with Mesh(backend, {'dp': -1, 'tp': 2})"
        )
    if "tp" not in mesh.axis_names:
        raise StrategyError(
            f"TensorParallelModel needs a mesh with a 'tp' axis, got axes {list(mesh.axis_names)}; "
            "e.g. Mesh(backend, {'dp': -1, 'tp': 2})"
        )
    extra = [f"{a}={mesh.size(a)}" for a in mesh.axis_names if a not in _AXES and mesh.size(a) > 1]
    if extra:
        raise StrategyError(
            f"TensorParallelModel spans the mesh axes dp and tp; this mesh also has {extra}: pass the "
            "stage's sub-model to the pipeline/hybrid strategy instead"
        )


def _broadcast_state(module: nn.Module, group: CommunicationBackend) -> None:
    """Every parameter and buffer of ``module`` takes group rank 0's values (one message per dtype)."""
    if group.world_size == 1:
        return
    seen: set[int] = set()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in module.state_dict(keep_vars=True).values():
        if id(t) not in seen and t.numel():
            seen.add(id(t))
            by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            group.broadcast(flat, 0)
            offset = 0
            for t in tensors:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class TensorParallelModel(ZeRO1Model):
    """Tensor parallelism over ``mesh["tp"]``, data parallelism (DDP buckets) over ``mesh["dp"]``.

    Args:
        module: the plain model; every rank builds it with the same structure (values come from rank 0).
        mesh: a :class:`~dtlab.backends.Mesh` with a ``tp`` axis and optionally a ``dp`` axis.
        plan: ``{"fqn-pattern": style}``; see :mod:`dtlab.models._tensor_plan` and
            :func:`transformer_plan`. Checked before any communication.
        gradient_sync: how gradients are averaged over dp; ``None`` (default) lets the optimizer choose
            (``DDPOptimizer``: all-reduce; ``ZeRO1Optimizer``: reduce-scatter of each rank's shard).
        bucket_cap_mb, reduce_dtype, find_unused_parameters, broadcast_buffers: as for DDPModel.
    """

    strategy_name: ClassVar[str] = "tensor"

    def __init__(
        self,
        module: nn.Module,
        mesh: Any,
        plan: Plan,
        *,
        gradient_sync: GradientSync | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"TensorParallelModel wraps a torch.nn.Module, got {type(module).__name__}")
        _check_mesh(mesh)
        tp = mesh["tp"]
        resolved = resolve_plan(module, plan, tp.world_size)
        _broadcast_state(module, tp)  # then DDP broadcasts each shard over dp: rank 0's values everywhere
        partial = apply_plan(module, resolved, tp)
        super().__init__(
            module, mesh["dp"], gradient_sync=gradient_sync or "all_reduce", world=mesh.backend, **kwargs
        )
        self.mesh = mesh
        self.tp_group: CommunicationBackend = tp
        self._span = mesh[_AXES]
        self._coords = {a: mesh.coordinate(a) for a in _AXES}
        self._chosen_sync = gradient_sync
        self._partial = [p for p in partial if p.requires_grad]
        self._param_of = {n: p for n, p in module.named_parameters()}

    # ------------------------------------------------------------------ forward / loss
    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of vocabulary-split logits (``F.cross_entropy`` over the whole vocabulary)."""
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group)

    def _begin_backward(self) -> None:
        if not self._in_backward and self._sync and self._partial and self._grads_synced:
            raise StrategyError(
                "TensorParallelModel with sequence parallelism: a backward pass started while the gradients "
                "of the last synchronized backward are still there; call opt.zero_grad() between steps and "
                "accumulate micro-batches inside model.no_sync()"
            )
        super()._begin_backward()

    def _end_backward(self) -> None:
        sync = self._sync
        super()._end_backward()
        if sync and self._partial and self.tp_group.world_size > 1:
            # sequence parallel: norms and row-parallel biases saw only this rank's chunk of the sequence
            grads = [p.grad for p in self._partial if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.tp_group.all_reduce(flat, ReduceOp.SUM)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _launch(self, i: int) -> tuple[Work, Any]:
        if self.dp_backend.world_size == 1:  # no dp axis: the local gradient is already the average
            return CompletedWork(), None
        return super()._launch(i)

    def _complete(self, i: int, extra: Any) -> None:
        if self.dp_backend.world_size == 1:
            if self.gradient_sync == "reduce_scatter":
                self._grad_state = "averaged"
            return
        super()._complete(i, extra)

    # ------------------------------------------------------------------ optimizer protocol
    def attach_optimizer(self, optimizer: Any) -> None:
        super().attach_optimizer(optimizer)
        self.gradient_sync = gradient_sync_for("TensorParallelModel", self._chosen_sync, optimizer)

    def grad_norm_group(self) -> CommunicationBackend:
        """The group the norm's parts are summed over: every rank of the dp x tp mesh."""
        return cast(CommunicationBackend, self._span)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """The gradient parts this rank counts in the global norm: tp shards on every tp rank,
        replicated tensors on tp rank 0 only; dp replicas on dp rank 0 (all-reduce mode) or each dp
        rank's own slice (reduce-scatter mode). Summed over :meth:`grad_norm_group`."""
        self._settle()
        out: list[torch.Tensor] = []
        if self.gradient_sync == "all_reduce":
            for _, p in self._trainable:
                if p.grad is not None and counts_in_norm(placement_of(p), self._coords, _AXES):
                    out.append(p.grad)
            return out, False
        for unit, buf in zip(self._units, self._grad_bufs, strict=True):
            if buf is None:
                continue
            lo, _ = unit.shard_bounds()
            for slot, a, b, off in unit.shard_slots():
                param = unit.params[unit.slots.index(slot)]
                if counts_in_norm(placement_of(param), self._coords, ("tp",)):
                    out.append(buf[lo + off : lo + off + b - a])
        return out, False

    def placed(self, name: str) -> tuple[Placement, int, int]:
        """Parameter ``name``'s placement, this rank's coordinate and the size of its axis."""
        p = self._param_of[name]
        placement = placement_of(p)
        if isinstance(placement, Shard):
            return placement, self.mesh.coordinate(placement.axis), self.mesh.size(placement.axis)
        return placement, 0, 1

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors keyed like the original module's ``state_dict()`` (collective over tp)."""
        out: dict[str, torch.Tensor] = {}
        tp = self.tp_group
        for key, t in self.module.state_dict(keep_vars=True).items():
            placement = placement_of(t)
            if not isinstance(placement, Shard) or tp.world_size == 1:
                out[key] = t.detach().clone()
                continue
            out[key] = gather_over_tp(t, placement, tp)
        return out

    def sharded_state_dict(self) -> ShardedState:
        """This rank's part: its tp shards split over dp, replicated tensors split over dp x tp."""
        world = self.mesh.backend
        state = new_state(self.strategy_name, world.world_size, world.rank, mesh=dict(self.mesh.shape))
        dp, tp = self.dp_backend, self.tp_group
        span = self._span
        for key, t in self.module.state_dict(keep_vars=True).items():
            placement = placement_of(t)
            flat = t.detach().reshape(-1)
            if isinstance(placement, Shard):
                s, e = even_range(t.numel(), dp.world_size, dp.rank)
                add_placed_slice(
                    state, key, t.shape, placement, tp.rank, tp.world_size, t.dtype, s, e, flat[s:e]
                )
            else:
                s, e = even_range(t.numel(), span.world_size, span.rank)
                add_slice(state, key, t.shape, t.dtype, s, e, flat[s:e])
        return state

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load from any saved mesh (another tp, DDP/ZeRO, a plain module's full tensors)."""
        index = ShardIndex(shards)
        tp = self.tp_group
        with torch.no_grad():
            for key, t in self.module.state_dict(keep_vars=True).items():
                placement = placement_of(t)
                if isinstance(placement, Replicate):
                    full = index.full(key)
                    if tuple(full.shape) != tuple(t.shape):
                        raise StrategyError(
                            f"{key!r} has shape {tuple(full.shape)} in the checkpoint but {tuple(t.shape)} "
                            "in the model"
                        )
                    t.data.copy_(full.to(device=t.device, dtype=t.dtype))
                else:
                    data = read_placed(index, key, t.shape, placement, tp.rank, tp.world_size, 0, t.numel())
                    t.data.copy_(data.view(t.shape).to(device=t.device, dtype=t.dtype))
