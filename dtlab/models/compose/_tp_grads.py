"""``param.grad`` of a tensor-parallel parameter (of every parameter on a pipeline rank) refuses norms:
the norm of a shard (of one stage's parameters) is not the norm of the gradient.

Under DDP and ZeRO-1 with all-reduce, ``param.grad`` of a parameter split over ``tp`` is this rank's
piece of the averaged gradient (a view of its bucket). Element-wise use is right on a piece (torch's
``clip_grad_value_``, indexing, in-place writes, a copy), but torch's ``clip_grad_norm_`` over
``model.parameters()`` would take each tp rank's partial norm: a norm that differs from one process's
and a clip coefficient that differs between tp ranks, so their replicated parameters drift apart.
On a pipeline rank the same holds for every parameter: ``model.parameters()`` has gradients for this
rank's stages only. After each synchronization such a ``param.grad`` is a
:class:`~dtlab.models.dp._grad_guard.GradientStandIn` wrapping that view: every operation runs on the
view but a norm, which raises naming ``opt.clip_grad_norm_``. The model's next forward (or
``zero_grad()``) puts the view back.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab.models.dp._grad_guard import GradientStandIn
from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["TensorParallelGrads"]

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
