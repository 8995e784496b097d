"""The gradients of the parameters split over tp, or left whole with partial gradients, after each
synchronization of the data-parallel strategy (its post-sync hooks); where those gradients lie
(:func:`grads_of`).

Parameters left whole whose gradient each tp rank computes only its share of (sequence parallelism's
norms and row-parallel biases, ``replicated_with_grad_allreduce``) are summed over tp after each
synchronization, after the dp average (the two sums commute). A gradient kept across steps
(``opt.step()`` without ``zero_grad()``: torch adds the next backward into ``.grad``) still holds the
last sum, the same on every tp rank; summing it again would count it tp times. So the next forward
with gradients keeps it on tp rank 0 only; a second synchronized backward before the step is refused
(:meth:`PartialGrads.before_accumulate`).

``param.grad`` of a tensor-parallel parameter (of every parameter on a pipeline rank) refuses norms:
the norm of a shard (of one stage's parameters) is not the norm of the gradient. Under DDP and ZeRO-1
with all-reduce, ``param.grad`` of a parameter split over ``tp`` is this rank's piece of the averaged
gradient (a view of its bucket). Element-wise use is right on a piece (torch's ``clip_grad_value_``,
indexing, in-place writes, a copy), but torch's ``clip_grad_norm_`` over ``model.parameters()`` would
take each tp rank's partial norm: a norm that differs from one process's and a clip coefficient that
differs between tp ranks, so their replicated parameters drift apart. On a pipeline rank the same
holds for every parameter: ``model.parameters()`` has gradients for this rank's stages only. After each
synchronization such a ``param.grad`` is a :class:`~dtlab.models.dp._grad_guard.GradientStandIn`
wrapping that view: every operation runs on the view but a norm, which raises naming
``opt.clip_grad_norm_``. The model's next forward (or ``zero_grad()``) puts the view back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models.dp._grad_guard import GradientStandIn
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.tensor._comm import sum_over_tp

__all__ = ["PartialGrads", "TensorParallelGrads", "grads_of"]

_NORMS = frozenset({torch.ops.aten.linalg_vector_norm, torch.ops.aten.norm, torch.ops.aten._foreach_norm})  # noqa: SLF001 - torch's op namespace


def _message(name: str, who: str, staged: bool) -> str:
    what = (
        "on this pipeline rank, which holds only its stages' parameters: the norm over model.parameters() "
        "misses the other stages', so torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would clip "
        "each stage by a different partial norm (a wrong step)"
        if staged
        else "this rank's tensor-parallel piece of the gradient: its norm is not the gradient's, so "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would clip each tp rank by a different "
        "partial norm (a wrong step, replicated parameters drifting apart)"
    )
    return (
        f"param.grad of {name!r} under {who} is {what}. "
        "Clip with opt.clip_grad_norm_(max_norm) (the global norm over the whole mesh, as one process's), "
        "or opt.clip_grad_value_(value); element-wise use of param.grad (clip_grad_value_, copies, "
        "in-place writes) works on the piece"
    )


class TensorParallelGrads:
    """Wraps the ``.grad`` of the tp-split parameters ``split`` (all parameters where ``staged``: a
    pipeline rank) after each synchronization of ``dp`` (where they are whole views: DDP, ZeRO-1 with
    all-reduce) and unwraps them on :meth:`release`."""

    def __init__(self, dp: DataParallelModel, split: set[str], who: str, staged: bool) -> None:
        #: each guarded parameter and its refusal, written once
        self._params = [
            (p, _message(n, who, staged)) for n, p in dp.trainable_parameters() if staged or n in split
        ]
        self._wrapped: list[tuple[nn.Parameter, GradientStandIn]] = []
        if self._params:
            dp.register_post_sync_hook(self.guard)

    def guard(self) -> None:
        for p, message in self._params:
            g = p.grad
            if g is not None and type(g) is torch.Tensor:  # not a stand-in of a sharded gradient
                wrapped = GradientStandIn(g, message, piece=g, refused=_NORMS)
                p.grad = wrapped
                self._wrapped.append((p, wrapped))

    def release(self) -> None:
        """Before a forward: the views again (a ``.grad`` set since, or None, is left alone)."""
        for p, wrapped in self._wrapped:
            if p.grad is wrapped:
                p.grad = wrapped.piece
        self._wrapped.clear()


def grads_of(
    dp: DataParallelModel, wanted: Callable[[str], bool], whole: bool | None = None
) -> list[torch.Tensor]:
    """This rank's synchronized gradient of every parameter whose name ``wanted`` accepts: the whole
    ``.grad`` where ``whole`` (default: where the strategy keeps whole gradients, DDP and ZeRO-1), else
    the pieces of its flat gradient shards (each rank holds the average of its own slice). The list
    has the same layout on every rank with the same local shapes (the same buckets and units)."""
    if dp.keeps_whole_grads if whole is None else whole:
        return [g for n, g in dp.whole_grads() if wanted(n)]
    out: list[torch.Tensor] = []
    for unit in dp.shard_units():
        g = dp.shard_grad(unit)
        out.extend(g[off : off + b - a] for slot, a, b, off in unit.shard_slots() if wanted(slot.name))
    return out


class PartialGrads:
    """The partial gradients of the parameters ``names`` (none at tp = 1) of ``dp``'s module."""

    def __init__(self, dp: DataParallelModel, names: set[str], tp: CommunicationBackend) -> None:
        self.dp, self.names, self.tp = dp, names, tp
        #: whether the gradients may hold a sum over tp made since the last zero_grad()
        self._summed = False
        if names:
            dp.register_post_sync_hook(self.sum)

    def sum(self) -> None:
        """After the dp reduction: each partial gradient summed over tp."""
        sum_over_tp(grads_of(self.dp, self.names.__contains__), self.tp)
        self._summed = True

    def before_accumulate(self, who: str) -> None:
        """Before a forward with gradients or a pipelined step of the model ``who``: refused while the
        last synchronized gradients are there (before the step); a sum over tp kept from the last step
        stays on tp rank 0 only, so the next sum counts it once."""
        dp = self.dp
        if self.names and dp.require_backward_grad_sync and dp.grads_synced:
            raise StrategyError(
                f"{who} with sequence parallelism: a synchronized step started while the "
                "gradients of the last one are still there; call opt.zero_grad() between steps and "
                "accumulate micro-batches inside model.no_sync()"
            )
        if self._summed:
            self._summed = False
            if self.tp.rank:
                for g in grads_of(self.dp, self.names.__contains__):
                    g.zero_()

    def cleared(self) -> None:
        """``zero_grad()``: nothing summed is held any more."""
        self._summed = False
