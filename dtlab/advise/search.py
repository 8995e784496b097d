"""Every plan for a model on a cluster, predicted and ranked by step time among those that fit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dtlab.advise.predict import Memo, Prediction, predict
from dtlab.advise.spec import (
    DP_STRATEGIES,
    SCHEDULES,
    Candidate,
    ClusterSpec,
    ModelSpec,
    OptimizerSpec,
    StrategyOptions,
)
from dtlab.core import pairs
from dtlab.errors import ArgumentError

__all__ = ["Advice", "advise", "candidates", "runnable"]

#: the optimizer strategy that drives each data-parallel choice
_OPTIMIZER_OF = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "zero3"}


def runnable(c: Candidate) -> bool:
    """Whether dtlab has a model strategy for the plan today, from the pairing table: the
    data-parallel strategies alone, ``tensor`` for tp x dp, ``pipeline`` for pp x dp, ``hybrid`` for
    any mesh. Activation checkpointing as planned here (per block) is what dtlab does without a
    pipeline; with one dtlab checkpoints whole stages, which this model does not predict."""
    if c.tp == 1 and c.pp == 1:
        return c.strategy in pairs.PAIRINGS
    if c.checkpointing and c.pp > 1:
        return False
    wanted = _OPTIMIZER_OF[c.strategy]
    models = ["hybrid"]
    if c.pp == 1:
        models.insert(0, "tensor")
    elif c.tp == 1:
        models.insert(0, "pipeline")
    return any(m in pairs.PAIRINGS and wanted in pairs.PAIRINGS[m].optimizers for m in models)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    ranks: int,
    global_batch: int,
    *,
    strategies: tuple[str, ...] = DP_STRATEGIES,
    schedules: tuple[str, ...] = SCHEDULES,
    checkpointing: tuple[bool, ...] = (False, True),
    interleave: int = 2,
) -> Iterator[Candidate]:
    """Every (strategy, dp, tp, pp, schedule, micro-batches, checkpointing) with ``dp tp pp = ranks``
    and the micro-batches dividing the batch per dp rank, at least ``pp`` of them."""
    for pp in _divisors(ranks):
        for tp in _divisors(ranks // pp):
            dp = ranks // (pp * tp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            if pp == 1:
                plans = [("none", 1, 1)]
            else:
                plans = []
                for m in _divisors(local):
                    if m < pp:
                        continue
                    for sched in schedules:
                        if sched == "interleaved_1f1b":
                            if m % pp == 0:
                                plans.append((sched, m, interleave))
                        else:
                            plans.append((sched, m, 1))
            for strategy in strategies:
                for sched, m, v in plans:
                    for ckpt in checkpointing:
                        yield Candidate(strategy, dp, tp, pp, sched, m, v, ckpt)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Advice:
    """The plans that fit, fastest first, and how many plans were considered."""

    plans: list[Prediction]
    considered: int


def advise(
    spec: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    optimizer: OptimizerSpec | None = None,
    options: StrategyOptions | None = None,
    strategies: tuple[str, ...] = DP_STRATEGIES,
    checkpointing: tuple[bool, ...] = (False, True),
    runnable_only: bool = False,
) -> Advice:
    """Every feasible plan (fits in memory, every size divides), fastest predicted step first
    (ties: least memory)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ArgumentError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    unknown = [s for s in strategies if s not in DP_STRATEGIES]
    if unknown:
        raise ArgumentError(
            f"unknown data-parallel strategies {unknown}; choose from {', '.join(DP_STRATEGIES)}"
        )
    out = []
    considered = 0
    memo = Memo()
    for c in candidates(cluster.ranks, global_batch, strategies=strategies, checkpointing=checkpointing):
        ok = runnable(c)
        if runnable_only and not ok:
            continue
        considered += 1
        p = predict(
            spec, cluster, c, global_batch, optimizer=optimizer, options=options, runnable=ok, memo=memo
        )
        if p.fits:
            out.append(p)
    out.sort(key=lambda p: (p.step_seconds, p.memory.total, p.candidate.label))
    return Advice(out, considered)
