"""Memory and traffic of the five data-parallel strategies over one rank's parameters.

Exact byte counts, as the strategies hold them and the backends count them (ring convention of
docs/backends.md: an all-reduce of ``n`` bytes moves ``floor(2 (P-1) n / P)``, a reduce-scatter or
all-gather ``(P-1)`` times the shard's bytes), for one training step: forward, backward and the
optimizer step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dtlab.advise.layout import Flat, Tensor, buckets, fsdp_units, module_groups, zero3_units
from dtlab.advise.precision import Precision
from dtlab.advise.spec import OptimizerSpec, StrategyOptions

__all__ = ["DataParallelCost", "Ops", "data_parallel_cost"]

#: kind -> (calls, bytes sent by this rank), the keys of ``backend.stats``
Ops = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class DataParallelCost:
    """Bytes one rank holds after a step and what it sends over the dp axis during one."""

    parameters: int
    gradients: int
    optimizer_state: int
    #: what ``memory_report()["peak_gathered_parameters"]`` reports: the most parameter bytes held
    #: whole at once during the step (the whole model for DDP/ZeRO-1/2)
    peak_gathered_parameters: int
    #: bytes held only during the step, beyond the resting state: gathered units and a unit's
    #: whole gradient (ZeRO-3/FSDP; every unit's while gradients accumulate), the whole gradient
    #: buckets in flight (ZeRO-2), the compute copies of the weights (mixed precision)
    transient: int
    #: everything sent over dp in a step, per ``backend.stats`` kind
    ops: Ops = field(default_factory=dict)
    #: the share of ``ops`` that reduces gradients (overlaps the last backward, bucket by bucket)
    grad_ops: Ops = field(default_factory=dict)
    #: the share of ``ops`` that gathers parameters (ZeRO-1/2: after the step; ZeRO-3/FSDP: before
    #: each use, prefetched behind the compute)
    gather_ops: Ops = field(default_factory=dict)
    #: bytes of the last gradient bucket or unit reduced: it waits for the whole backward
    last_reduce: int = 0


def _add(ops: Ops, kind: str, calls: int, nbytes: int) -> None:
    c, b = ops.get(kind, (0, 0))
    ops[kind] = (c + calls, b + nbytes)


def _optimizer(sizes: Sequence[int], opt: OptimizerSpec, prec: Precision) -> int:
    """State of a torch optimizer stepping tensors of these element counts (and their master copies)."""
    per = prec.state_bytes(opt.states_per_element)
    return sum(per * n + opt.bytes_per_tensor for n in sizes)


def _sharded_optimizer(flats: Sequence[Flat], opt: OptimizerSpec, prec: Precision) -> int:
    """State of the sharded strategies' optimizer on the rank that holds the most: one piece (its own
    per-tensor state) per parameter overlapping the rank's shard, moments for real elements only.

    Per rank, from difference arrays over all flats at once (a 70B model on 1,024 ranks has thousands
    of flats and plans): a parameter at ``[s, s + n)`` of a flat is a piece on ranks ``s // shard`` to
    ``(s + n - 1) // shard``; a flat's real elements fill its shards up to ``numel``."""
    if not flats:
        return 0
    ranks = flats[0].padded // flats[0].shard
    pieces = np.zeros(ranks + 1, dtype=np.int64)
    real = np.zeros(ranks + 2, dtype=np.int64)
    first: list[int] = []
    last: list[int] = []
    for f in flats:
        at = 0
        for n in f.members or (f.numel,):
            if n:
                first.append(at // f.shard)
                last.append((at + n - 1) // f.shard + 1)
            at += n
        full, rem = divmod(f.numel, f.shard)
        real[0] += f.shard
        real[full] += rem - f.shard
        real[full + 1] -= rem
    np.add.at(pieces, np.asarray(first, dtype=np.int64), 1)
    np.add.at(pieces, np.asarray(last, dtype=np.int64), -1)
    per = prec.state_bytes(opt.states_per_element)
    held = per * np.cumsum(real)[:ranks] + opt.bytes_per_tensor * np.cumsum(pieces)[:ranks]
    return int(held.max())


def _max_pair(groups: Sequence[int]) -> int:
    if not groups:
        return 0
    if len(groups) == 1:
        return groups[0]
    return max(a + b for a, b in itertools.pairwise(groups))


def _merge(*parts: Ops) -> Ops:
    out: Ops = {}
    for part in parts:
        for kind, (calls, nbytes) in part.items():
            _add(out, kind, calls, nbytes)
    return out


def _unused_marks(
    ops: Ops, strategy: str, tensors: Sequence[Tensor], p: int, options: StrategyOptions
) -> None:
    """``find_unused_parameters``: after the synchronization, one all-reduce of a float64 per trainable
    parameter (which ones each rank used); ZeRO-3/FSDP first compare the units every rank gathered
    (one all-reduce of two float64)."""
    if not options.find_unused_parameters or p == 1:
        return
    _add(ops, "all_reduce", 1, 2 * (p - 1) * 8 * len(tensors) // p)
    if strategy in ("zero3", "fsdp"):
        _add(ops, "all_reduce", 1, 2 * (p - 1) * 16 // p)


def data_parallel_cost(
    strategy: str,
    tensors: Sequence[Tensor],
    p: int,
    options: StrategyOptions,
    optimizer: OptimizerSpec,
    precision: Precision,
    *,
    keep_gathered: bool = False,
    passes: int = 1,
    recompute: bool = False,
) -> DataParallelCost:
    """Memory and dp traffic of ``strategy`` over ``p`` ranks holding ``tensors``.

    ``keep_gathered`` (ZeRO-3/FSDP under a pipeline, as torchtitan runs FSDP with pipelining): the
    stage's units are gathered once per step and kept for all micro-batches (one all-gather and one
    reduce-scatter per unit and step; the whole stage gathered at the peak). ``passes``: micro-batches
    accumulated without a pipeline; gradients are reduced once per step (``no_sync`` on all but the
    last, as dtlab's Trainer does), ZeRO-3/FSDP gather their units again for every micro-batch and
    keep the whole gradients until the last one. ``recompute`` (per-block checkpointing): ZeRO-3's
    recomputed forward gathers each block's modules once more, all but the block's last (torch's
    checkpoint stops before it), the first twice more (as measured); FSDP's block is still gathered
    for its backward. FSDP's root unit (``reshard_after_forward=None``, as FSDP2) stays gathered from
    its forward to its backward: one all-gather per pass, its forward's."""
    pe, ge, re = precision.params, precision.grads, precision.reduce
    whole_grads = sum(t.numel for t in tensors) * ge
    grad_ops: Ops = {}
    gather_ops: Ops = {}
    accumulating = keep_gathered or passes > 1  # whole gradients kept across micro-batches
    #: gathers per pass beyond (below) ``gathers``, by unit or parameter key
    again: dict[str, int] = {}
    if strategy in ("ddp", "zero1", "zero2"):
        cost = _bucketed_cost(strategy, tensors, p, options, optimizer, precision, accumulating)
        _unused_marks(cost.ops, strategy, tensors, p, options)
        return cost
    if strategy == "zero3":
        units = zero3_units(tensors, p, options.persistence_threshold)
        persistent = sum(u.padded for u in units if u.persistent)
        groups = module_groups(tensors, units)
        gathered = _max_pair(groups) if options.prefetch else max(groups, default=0)
        if keep_gathered:
            gathered = sum(groups)
        peak = persistent + gathered
        gathers = 1 if keep_gathered else 2 * passes
    elif strategy == "fsdp":
        units = fsdp_units(tensors, p)
        root = [u for u in units if u.key == "<root>"]
        blocks = [u.padded for u in units if u.key != "<root>"]
        persistent = 0
        if keep_gathered or options.reshard_after_forward is False:
            gathered = sum(u.padded for u in units)
        else:
            gathered = sum(u.padded for u in root) + (
                _max_pair(blocks) if options.prefetch else max(blocks, default=0)
            )
        peak = gathered
        per_pass = 1 if options.reshard_after_forward is False else 2
        gathers = 1 if keep_gathered else per_pass * passes
        if options.reshard_after_forward is None and not keep_gathered:  # the root kept for its backward
            again["<root>"] = -1  # per pass: gathered by its forward only
    else:
        raise ValueError(f"unknown data-parallel strategy {strategy!r}")
    shards = sum(u.shard for u in units)
    largest = max((u.padded for u in units if not u.persistent), default=0)
    last = 0
    if recompute and strategy == "zero3" and not keep_gathered:
        first_mod: dict[int, str] = {}
        last_mod: dict[int, str] = {}
        for t in tensors:
            if t.unit != "<root>":
                first_mod.setdefault(t.layer, t.module)
                last_mod[t.layer] = t.module
        for t in tensors:
            if t.unit != "<root>" and t.module != last_mod[t.layer]:
                # the block's first module once more: gathered for the backward before the
                # recomputation gathers and frees it
                again[t.name] = 2 if t.module == first_mod[t.layer] else 1
    if p > 1:
        for u in units:
            k = 1 if u.persistent else gathers + passes * again.get(u.key, 0)
            _add(gather_ops, "all_gather", k, k * (p - 1) * u.shard * pe)
            _add(grad_ops, "reduce_scatter", 1, (p - 1) * u.shard * re)
        last = (p - 1) * units[0].shard * re if units else 0  # the first unit's gradient comes last
    transient = (peak - persistent) * pe + (whole_grads if accumulating else largest * ge)
    if precision.compute < pe:
        transient += peak * precision.compute
    ops = _merge(grad_ops, gather_ops)
    _unused_marks(ops, strategy, tensors, p, options)
    return DataParallelCost(
        parameters=shards * pe + persistent * pe,
        gradients=shards * ge,
        optimizer_state=_sharded_optimizer(units, optimizer, precision),
        peak_gathered_parameters=peak * pe,
        transient=transient,
        ops=ops,
        grad_ops=grad_ops,
        gather_ops=gather_ops,
        last_reduce=last,
    )


def _bucketed_cost(
    strategy: str,
    tensors: Sequence[Tensor],
    p: int,
    options: StrategyOptions,
    optimizer: OptimizerSpec,
    precision: Precision,
    accumulating: bool,
) -> DataParallelCost:
    """DDP, ZeRO-1 and ZeRO-2: whole parameters in buckets, reduced once per step. ZeRO-2's transient
    gradient: two consecutive buckets (one filling, one in flight), or the whole gradient in
    ``param.grad`` while micro-batches accumulate (``accumulating``)."""
    pe, ge, re = precision.params, precision.grads, precision.reduce
    grad_ops: Ops = {}
    gather_ops: Ops = {}
    bks = buckets(tensors, p, options.bucket_cap_mb, pe)
    whole = sum(b.padded for b in bks)
    shards = sum(b.shard for b in bks)
    last = 0
    if p > 1:
        if strategy == "ddp" or (strategy == "zero1" and options.gradient_sync == "all_reduce"):
            sizes = [2 * (p - 1) * b.padded * re // p for b in bks]
            _add(grad_ops, "all_reduce", len(bks), sum(sizes))
        else:
            sizes = [(p - 1) * b.shard * re for b in bks]
            _add(grad_ops, "reduce_scatter", len(bks), sum(sizes))
        last = sizes[-1]
        if strategy != "ddp":
            _add(gather_ops, "all_gather", len(bks), sum((p - 1) * b.shard * pe for b in bks))
    if strategy == "ddp":
        state = _optimizer([t.numel for t in tensors], optimizer, precision)
    else:
        state = _sharded_optimizer(bks, optimizer, precision)
    grads = shards * ge if strategy == "zero2" else whole * ge
    transient = 0
    if strategy == "zero2":
        transient = (whole if accumulating else _max_pair([b.padded for b in bks])) * ge
    if precision.compute < pe:
        transient += whole * precision.compute  # autocast's copies, forward to backward
    return DataParallelCost(
        parameters=whole * pe,
        gradients=grads,
        optimizer_state=state,
        peak_gathered_parameters=whole * pe,
        transient=transient,
        ops=_merge(grad_ops, gather_ops),
        grad_ops=grad_ops,
        gather_ops=gather_ops,
        last_reduce=last,
    )
