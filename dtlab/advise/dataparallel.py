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

from dtlab.advise.layout import Flat, Tensor, buckets, fsdp_units, module_groups, zero3_units
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
    #: whole gradient (ZeRO-3/FSDP), the whole gradient buckets in flight (ZeRO-2)
    transient: int
    ops: Ops = field(default_factory=dict)


def _add(ops: Ops, kind: str, calls: int, nbytes: int) -> None:
    c, b = ops.get(kind, (0, 0))
    ops[kind] = (c + calls, b + nbytes)


def _optimizer(flats_or_sizes: Sequence[int], opt: OptimizerSpec, e: int) -> int:
    """State of a torch optimizer stepping tensors of these element counts."""
    return sum(opt.states_per_element * n * e + opt.bytes_per_tensor for n in flats_or_sizes)


def _max_pair(groups: Sequence[int]) -> int:
    if not groups:
        return 0
    if len(groups) == 1:
        return groups[0]
    return max(a + b for a, b in itertools.pairwise(groups))


def _sharded_traffic(units: Sequence[Flat], p: int, e: int, gathers: int) -> Ops:
    ops: Ops = {}
    if p == 1:
        return ops
    for u in units:
        n = (p - 1) * u.shard * e
        k = 1 if u.persistent else gathers
        _add(ops, "all_gather", k, k * n)
        _add(ops, "reduce_scatter", 1, n)
    return ops


def data_parallel_cost(
    strategy: str,
    tensors: Sequence[Tensor],
    p: int,
    options: StrategyOptions,
    optimizer: OptimizerSpec,
    dtype_bytes: int,
    *,
    keep_gathered: bool = False,
) -> DataParallelCost:
    """Memory and dp traffic of ``strategy`` over ``p`` ranks holding ``tensors``.

    ``keep_gathered`` (ZeRO-3/FSDP under a pipeline, as torchtitan runs FSDP with pipelining): the
    stage's units are gathered once per step and kept for all micro-batches (one all-gather and one
    reduce-scatter per unit and step; the whole stage gathered at the peak)."""
    e = dtype_bytes
    if strategy in ("ddp", "zero1", "zero2"):
        bks = buckets(tensors, p, options.bucket_cap_mb, e)
        whole = sum(b.padded for b in bks) * e
        shards = sum(b.shard for b in bks) * e
        ops: Ops = {}
        if p > 1:
            rs = sum((p - 1) * b.shard * e for b in bks)
            ar = sum(2 * (p - 1) * b.padded * e // p for b in bks)
            if strategy == "ddp" or (strategy == "zero1" and options.gradient_sync == "all_reduce"):
                _add(ops, "all_reduce", len(bks), ar)
            else:
                _add(ops, "reduce_scatter", len(bks), rs)
            if strategy != "ddp":
                _add(ops, "all_gather", len(bks), rs)
        if strategy == "ddp":
            state = _optimizer([t.numel for t in tensors], optimizer, e)
        else:
            state = _optimizer([b.shard for b in bks], optimizer, e)
        grads = shards if strategy == "zero2" else whole
        return DataParallelCost(
            parameters=whole,
            gradients=grads,
            optimizer_state=state,
            peak_gathered_parameters=whole,
            transient=whole if strategy == "zero2" else 0,
            ops=ops,
        )
    if strategy == "zero3":
        units = zero3_units(tensors, p, options.persistence_threshold)
        persistent = sum(u.padded for u in units if u.persistent) * e
        groups = module_groups(tensors, units)
        gathered = _max_pair(groups) if options.prefetch else max(groups, default=0)
        if keep_gathered:
            gathered = sum(groups)
        peak = persistent + gathered * e
        gathers = 1 if keep_gathered else 2
    elif strategy == "fsdp":
        units = fsdp_units(tensors, p)
        root = [u for u in units if u.key == "<root>"]
        blocks = [u.padded for u in units if u.key != "<root>"]
        persistent = 0
        if keep_gathered or not options.reshard_after_forward:
            gathered = sum(u.padded for u in units)
        else:
            gathered = sum(u.padded for u in root) + (
                _max_pair(blocks) if options.prefetch else max(blocks, default=0)
            )
        peak = gathered * e
        gathers = 2 if options.reshard_after_forward and not keep_gathered else 1
    else:
        raise ValueError(f"unknown data-parallel strategy {strategy!r}")
    shards = sum(u.shard for u in units) * e
    largest = max((u.padded for u in units if not u.persistent), default=0) * e
    return DataParallelCost(
        parameters=shards + persistent,
        gradients=shards,
        optimizer_state=_optimizer([u.shard for u in units], optimizer, e),
        peak_gathered_parameters=peak,
        transient=peak - persistent + largest,
        ops=_sharded_traffic(units, p, e, gathers),
    )
