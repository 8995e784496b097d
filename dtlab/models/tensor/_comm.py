"""Tensor parallelism's collectives as autograd functions (Megatron's f/g pairs), so backward
communicates exactly what forward implies.

A column-parallel layer's input passes ``copy_to_tp`` (its gradient is a sum over the ranks' parts),
a row-parallel layer's output ``reduce_from_tp``. Sequence parallelism replaces that pair by
``gather_from_sequence`` / ``reduce_scatter_to_seq`` around the norm and dropout regions, which then
hold ``1/tp`` of the sequence: the same bytes (an all-reduce is a reduce-scatter plus an all-gather).
The sequence is dim ``-2`` (``(batch, seq, hidden)`` activations, ``(seq, hidden)`` position tables).

Tensors on the ``meta`` device carry no data: the collectives then only compute the output's shape
(how a pipeline finds the shapes between tensor-parallel stages before any rank computes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp, check_backend
from dtlab.core.placement import Shard
from dtlab.core.traced import eager_when_traced
from dtlab.errors import ArgumentTypeError, StrategyError, integer

__all__ = [
    "SharedInput",
    "check_divisible",
    "copy_to_tp",
    "gather_from_sequence",
    "gather_from_tp",
    "gather_heads_from_tp",
    "gather_over_tp",
    "reduce_from_tp",
    "reduce_scatter_to_seq",
    "scatter_to_sequence",
    "scatter_to_tp",
    "sum_over_tp",
    "tp_size",
]

_SEQ = -2

#: a collective (or the identity) of ``x`` over a tp group
Op = Callable[[torch.Tensor, CommunicationBackend], torch.Tensor]


class SharedInput:
    """One ``copy_to_tp`` (or sequence all-gather) per input tensor for the column-parallel layers of
    one model: layers that read the same tensor (separate q, k and v projections, an MLP's gate and
    up projections) share it, so backward all-reduces their summed input gradient once instead of
    once per layer (the same sum: an all-reduce is linear). Only with gradients on; it remembers the
    last input (weakly) and its shared output until that output's gradient is computed."""

    def __init__(self) -> None:
        self._last: tuple[weakref.ref[torch.Tensor], torch.Tensor, Op] | None = None

    def __call__(self, x: torch.Tensor, group: CommunicationBackend, fn: Op) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return fn(x, group)  # no backward to save a collective in
        last = self._last
        if last is not None and last[0]() is x and last[2] is fn:
            return last[1]
        y = fn(x, group)
        if y is x:  # tp = 1: nothing to share
            return y
        self._last = (weakref.ref(x), y, fn)
        y.register_hook(self._forget)  # backward reached it: every user has read it
        return y

    def _forget(self, grad: torch.Tensor) -> None:  # noqa: ARG002 - a tensor hook's signature
        self._last = None

    def __reduce__(self) -> tuple[type[SharedInput], tuple[()]]:  # a copied model remembers nothing
        return type(self), ()


def _identity(x: torch.Tensor, _group: CommunicationBackend) -> torch.Tensor:
    return x  # returned from a forward, autograd makes it a view of the input with its own history


def _all_reduce(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # a new tensor: never the input's storage
    if not out.is_meta:
        group.all_reduce(out, ReduceOp.SUM)
    return out


def _gather(x: torch.Tensor, group: CommunicationBackend, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    p = group.world_size
    dim = dim % x.dim()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((p, *moved.shape), dtype=x.dtype, device=x.device)
    if not x.is_meta:
        group.all_gather(out.view(-1), moved.view(-1))
    # (p, n, rest...) -> (p*n, rest...) -> back to dim
    return out.reshape(p * moved.shape[0], *moved.shape[1:]).movedim(0, dim)


def check_divisible(n: int, p: int, what: str, hint: str = "") -> None:
    """``what`` (of size ``n``) splits evenly over ``p`` ranks, or one error saying what to choose."""
    if p < 1:  # tp x sections, with sections=0 (a group has >= 1 rank)
        raise StrategyError(f"{what} splits into {p} parts; sections must be an int >= 1")
    if n % p:
        raise StrategyError(
            f"{what} is {n}, not divisible by tp={p}; {hint or f'choose a tp that divides {n}'}"
        )


def tp_size(group: object, who: str, **sizes: object) -> int:
    """The size of the tp ``group`` that the layer ``who`` is built over, after refusing a group that is
    not a backend and ``sizes`` (its feature counts) that are not ints >= 0, before either is read."""
    check_backend(group, f"{who}(group=...)")
    for name, n in sizes.items():
        if integer(n) is None or cast(int, n) < 0:
            raise ArgumentTypeError(f"{who}: {name} must be an int >= 0, got {n!r}")
    return cast(CommunicationBackend, group).world_size


def _chunk(x: torch.Tensor, group: CommunicationBackend, dim: int, what: str) -> torch.Tensor:
    p = group.world_size
    n = x.shape[dim]
    check_divisible(n, p, f"{what} (dim {dim % x.dim()})", f"use a size divisible by {p}")
    return x.narrow(dim, group.rank * (n // p), n // p).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    p = group.world_size
    dim = _SEQ % x.dim()
    n = x.shape[dim]
    what = f"sequence parallelism: the sequence (dim {dim})"
    check_divisible(n, p, what, f"use a sequence length divisible by {p}")
    moved = x.movedim(dim, 0)
    chunks = moved.reshape(p, n // p, *moved.shape[1:]).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    if not x.is_meta:
        group.reduce_scatter(out.view(-1), chunks.view(-1), ReduceOp.SUM)
    return out.movedim(0, dim)


#: one side of a pair each (forward on ``x``, or backward on its gradient)
_gather_last = partial(_gather, dim=-1)
_gather_seq = partial(_gather, dim=_SEQ)


class _Conjugate(torch.autograd.Function):
    """``forward_op`` on the input forward, ``backward_op`` on the output's gradient backward: each
    public collective below is this one function with its two sides. Each side is the other's adjoint,
    so a backward that builds a graph (``create_graph=True``: a gradient penalty on the inputs) records
    its side as this function with the sides swapped, and the second backward runs ``forward_op``
    (a collective run outside autograd would be taken for the identity: wrong second derivatives)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: CommunicationBackend, forward_op: Op, backward_op: Op
    ) -> torch.Tensor:
        ctx.group, ctx.forward_op, ctx.backward_op = group, forward_op, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if torch.is_grad_enabled():  # create_graph=True
            swapped = _Conjugate.apply(g, ctx.group, ctx.backward_op, ctx.forward_op)  # type: ignore[no-untyped-call]
            return swapped, None, None, None
        return ctx.backward_op(g, ctx.group), None, None, None


def _conjugate(x: torch.Tensor, group: CommunicationBackend, forward_op: Op, backward_op: Op) -> torch.Tensor:
    """``x`` itself over one rank (nothing to communicate either way)."""
    if group.world_size == 1:
        return x
    apply = eager_when_traced(_Conjugate.apply)  # traced: a graph break, the collective runs eagerly
    y = apply(x, group, forward_op, backward_op)  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, y)


def copy_to_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (a column-parallel input)."""
    return _conjugate(x, group, _identity, _all_reduce)


def reduce_from_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward (a row-parallel output)."""
    return _conjugate(x, group, _all_reduce, _identity)


def gather_from_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """All-gather along the last dim forward; backward keeps this rank's chunk."""
    return _conjugate(x, group, _gather_last, partial(_chunk, dim=-1, what="gather_from_tp backward"))


def gather_heads_from_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """All-gather along dim 1 (the heads of ``(batch, heads, query, key)`` attention weights) forward;
    backward keeps this rank's chunk."""
    what = "attention weights' backward"
    return _conjugate(x, group, partial(_gather, dim=1), partial(_chunk, dim=1, what=what))


def scatter_to_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """This rank's chunk of the last dim forward; backward all-gathers."""
    what = "RowParallelLinear(input_is_parallel=False) input"
    return _conjugate(x, group, partial(_chunk, dim=-1, what=what), _gather_last)


def gather_from_sequence(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """All-gather along the sequence (dim -2) forward; backward reduce-scatters it."""
    return _conjugate(x, group, _gather_seq, _reduce_scatter_seq)


def reduce_scatter_to_seq(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk of the sequence forward; backward all-gathers."""
    return _conjugate(x, group, _reduce_scatter_seq, _gather_seq)


def scatter_to_sequence(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """This rank's chunk of the sequence forward (of a replicated tensor); backward all-gathers."""
    what = "sequence parallelism: the sequence"
    return _conjugate(x, group, partial(_chunk, dim=_SEQ, what=what), _gather_seq)


def gather_over_tp(local: torch.Tensor, placement: Shard, tp: CommunicationBackend) -> torch.Tensor:
    """The whole tensor from every tp rank's shard ``local`` (collective over ``tp``)."""
    if tp.world_size == 1:
        return local.detach().clone()
    p, sections = tp.world_size, placement.sections
    parts = _gather(local.detach(), tp, placement.dim).chunk(p * sections, placement.dim)
    # gathered in rank order, each rank's part of every section: put each section's parts together
    return torch.cat([parts[r * sections + k] for k in range(sections) for r in range(p)], placement.dim)


def sum_over_tp(tensors: Sequence[torch.Tensor], tp: CommunicationBackend) -> None:
    """Replace each tensor by its sum over ``tp`` (in place; one all-reduce of them concatenated):
    sequence parallelism leaves the gradients of replicated parameters used inside the sequence-split
    region (norms, row-parallel biases) as partial sums over tp."""
    tensors = [t for t in tensors if t.numel()]
    if tp.world_size == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    tp.all_reduce(flat, ReduceOp.SUM)
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view_as(t))
