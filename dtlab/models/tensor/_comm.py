"""Tensor parallelism's collectives as autograd functions (Megatron's f/g pairs), so backward
communicates exactly what forward implies.

=========================  ====================================  ====================================
function                   forward                               backward
=========================  ====================================  ====================================
``copy_to_tp``             identity                              all-reduce (sum) over tp
``reduce_from_tp``         all-reduce (sum) over tp              identity
``gather_from_tp``         all-gather along the last dim         this rank's chunk of the last dim
``scatter_to_tp``          this rank's chunk of the last dim     all-gather along the last dim
``gather_from_sequence``   all-gather along the sequence         reduce-scatter along the sequence
``reduce_scatter_to_seq``  reduce-scatter along the sequence     all-gather along the sequence
``scatter_to_sequence``    this rank's chunk of the sequence     all-gather along the sequence
=========================  ====================================  ====================================

A column-parallel layer's input passes ``copy_to_tp`` (its gradient is a sum over the ranks' parts),
a row-parallel layer's output ``reduce_from_tp``. Sequence parallelism replaces that pair by
``gather_from_sequence`` / ``reduce_scatter_to_seq`` around the norm and dropout regions, which then
hold ``1/tp`` of the sequence: the same bytes (an all-reduce is a reduce-scatter plus an all-gather).
The sequence is dim ``-2`` (``(batch, seq, hidden)`` activations, ``(seq, hidden)`` position tables).

Tensors on the ``meta`` device carry no data: the collectives then only compute the output's shape
(how a pipeline finds the shapes between tensor-parallel stages before any rank computes).

:func:`gather_over_tp` (no autograd) puts a whole tensor together from every tp rank's shard, for
``full_state_dict``; :func:`broadcast_module_state` gives every tp rank rank 0's values before a plan
splits the layers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.core.placement import Shard
from dtlab.errors import StrategyError

__all__ = [
    "SharedInput",
    "broadcast_module_state",
    "copy_to_tp",
    "gather_from_sequence",
    "gather_from_tp",
    "gather_over_tp",
    "reduce_from_tp",
    "reduce_scatter_to_seq",
    "scatter_to_sequence",
    "scatter_to_tp",
]

_SEQ = -2

InputFn = Callable[[torch.Tensor, CommunicationBackend], torch.Tensor]


class SharedInput:
    """One ``copy_to_tp`` (or sequence all-gather) per input tensor for the column-parallel layers of
    one model: layers that read the same tensor (separate q, k and v projections, an MLP's gate and
    up projections) share it, so backward all-reduces their summed input gradient once instead of
    once per layer (the same sum: an all-reduce is linear). Only with gradients on; it remembers the
    last input (weakly) and its shared output until that output's gradient is computed."""

    def __init__(self) -> None:
        self._last: tuple[weakref.ref[torch.Tensor], torch.Tensor, InputFn] | None = None

    def __call__(self, x: torch.Tensor, group: CommunicationBackend, fn: InputFn) -> torch.Tensor:
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

    def __getstate__(self) -> dict[str, Any]:  # a copied model starts with nothing remembered
        return {}

    def __setstate__(self, _state: dict[str, Any]) -> None:
        self._last = None


def _all_reduce(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    if group.world_size == 1:
        return x
    out = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    if not out.is_meta:
        group.all_reduce(out, ReduceOp.SUM)
    return out


def _gather(x: torch.Tensor, group: CommunicationBackend, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    p = group.world_size
    if p == 1:
        return x
    dim = dim % x.dim()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((p, *moved.shape), dtype=x.dtype, device=x.device)
    if not x.is_meta:
        group.all_gather(out.view(-1), moved.view(-1))
    # (p, n, rest...) -> (p*n, rest...) -> back to dim
    return out.reshape(p * moved.shape[0], *moved.shape[1:]).movedim(0, dim)


def _chunk(x: torch.Tensor, group: CommunicationBackend, dim: int, what: str) -> torch.Tensor:
    p = group.world_size
    if p == 1:
        return x
    n = x.shape[dim]
    if n % p:
        raise StrategyError(
            f"{what}: dim {dim % x.dim()} of size {n} does not split evenly over tp={p}; "
            f"use a size divisible by {p}"
        )
    c = n // p
    return x.narrow(dim, group.rank * c, c).contiguous()


def _reduce_scatter(x: torch.Tensor, group: CommunicationBackend, dim: int) -> torch.Tensor:
    p = group.world_size
    if p == 1:
        return x
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % p:
        raise StrategyError(
            f"sequence parallelism: the sequence (dim {dim}) has {n} positions, not divisible by tp={p}; "
            f"use a sequence length divisible by {p}"
        )
    moved = x.movedim(dim, 0)
    chunks = moved.reshape(p, n // p, *moved.shape[1:]).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    if not x.is_meta:
        group.reduce_scatter(out.view(-1), chunks.view(-1), ReduceOp.SUM)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:  # noqa: ARG004 - torch.autograd.Function's signature
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ARG004 - torch.autograd.Function's signature
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(g, ctx.group, -1, "gather_from_tp backward"), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return _chunk(x, group, -1, "RowParallelLinear(input_is_parallel=False) input")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(g, ctx.group, -1), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, _SEQ)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(g, ctx.group, _SEQ), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group, _SEQ)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(g, ctx.group, _SEQ), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
        ctx.group = group
        return _chunk(x, group, _SEQ, "sequence parallelism: the sequence")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(g, ctx.group, _SEQ), None


def copy_to_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (a column-parallel input)."""
    return x if group.world_size == 1 else _CopyToTP.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_from_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward (a row-parallel output)."""
    return x if group.world_size == 1 else _ReduceFromTP.apply(x, group)  # type: ignore[no-untyped-call]


def gather_from_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """All-gather along the last dim forward; backward keeps this rank's chunk."""
    return x if group.world_size == 1 else _GatherFromTP.apply(x, group)  # type: ignore[no-untyped-call]


def scatter_to_tp(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """This rank's chunk of the last dim forward; backward all-gathers."""
    return x if group.world_size == 1 else _ScatterToTP.apply(x, group)  # type: ignore[no-untyped-call]


def gather_from_sequence(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """All-gather along the sequence (dim -2) forward; backward reduce-scatters it."""
    return x if group.world_size == 1 else _GatherFromSequence.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_scatter_to_seq(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk of the sequence forward; backward all-gathers."""
    return x if group.world_size == 1 else _ReduceScatterToSequence.apply(x, group)  # type: ignore[no-untyped-call]


def scatter_to_sequence(x: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """This rank's chunk of the sequence forward (of a replicated tensor); backward all-gathers."""
    return x if group.world_size == 1 else _ScatterToSequence.apply(x, group)  # type: ignore[no-untyped-call]


def gather_over_tp(local: torch.Tensor, placement: Shard, tp: CommunicationBackend) -> torch.Tensor:
    """The whole tensor from every tp rank's shard ``local`` (collective over ``tp``)."""
    local = local.detach().contiguous()
    if tp.world_size == 1:
        return local.clone()
    gathered = torch.empty((tp.world_size, *local.shape), dtype=local.dtype, device=local.device)
    tp.all_gather(gathered.view(-1), local.view(-1))
    full_shape = list(local.shape)
    full_shape[placement.dim] *= tp.world_size
    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    for c in range(tp.world_size):
        parts = gathered[c].chunk(placement.sections, dim=placement.dim)
        for box, part in zip(placement.boxes(full_shape, c, tp.world_size), parts, strict=True):
            full[box.slices()] = part
    return full


def broadcast_module_state(module: nn.Module, group: CommunicationBackend) -> None:
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
