"""Every plan for a model on a cluster, predicted and ranked by step time among those that fit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from dtlab.advise.precision import PRECISIONS, Precision
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
from dtlab.errors import ArgumentError, integer

__all__ = ["Advice", "Limits", "advise", "candidates", "runnable"]


def runnable(c: Candidate, spec: ModelSpec | None = None, precision: Precision | None = None) -> bool:
    """Whether dtlab has a model strategy for the plan today, from the pairing table: the
    data-parallel strategies alone, ``tensor`` for tp x dp, ``pipeline`` for pp x dp, ``hybrid`` for
    any mesh. dtlab checkpoints per block without a pipeline and per stage with one (not under
    zero-bubble); ``dtlab train`` cuts a pipeline into stages of equal numbers of blocks, keeps a
    shared weight in one stage (no tied embeddings across stages) and trains in its own precision
    policies (fp32 parameters)."""
    if spec is not None:
        if c.pp > 1 and (spec.layers % (c.pp * c.stages_per_rank) or spec.tied_embeddings):
            return False
    if precision is not None and (
        precision.name not in PRECISIONS or precision != Precision.named(precision.name)
    ):
        return False
    if c.tp == 1 and c.pp == 1:
        return c.strategy in pairs.PAIRINGS
    if c.pp > 1 and c.checkpointing == "block":
        return False
    if c.checkpointing == "stage" and c.schedule == "zero_bubble":
        return False
    wanted = pairs.default_optimizer(c.strategy)  # the pairing table: fsdp -> zero3
    models = ["hybrid"]
    if c.pp == 1:
        models.insert(0, "tensor")
    elif c.tp == 1:
        models.insert(0, "pipeline")
    return any(m in pairs.PAIRINGS and wanted in pairs.PAIRINGS[m].optimizers for m in models)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Limits:
    """What a search may try. ``max_tp``: the largest tensor-parallel size (default: one node);
    ``schedules``: pipeline schedules; ``checkpointing``: the modes to try (``"stage"`` only
    applies with a pipeline); ``micro_batch``: sequences per micro-batch to try (``None``: every
    size that divides the batch per dp rank); ``max_interleave``: the most chunks per rank."""

    strategies: tuple[str, ...] = DP_STRATEGIES
    schedules: tuple[str, ...] = SCHEDULES
    checkpointing: tuple[str, ...] = ("none", "block", "stage")
    max_tp: int | None = None
    micro_batch: tuple[int, ...] | None = None
    max_interleave: int = 8


def candidates(
    ranks: int,
    global_batch: int,
    *,
    strategies: tuple[str, ...] = DP_STRATEGIES,
    schedules: tuple[str, ...] = SCHEDULES,
    checkpointing: tuple[str | bool, ...] = ("none", "block", "stage"),
    layers: int | None = None,
    max_tp: int | None = None,
    micro_batch: tuple[int, ...] | None = None,
    max_interleave: int = 8,
) -> Iterator[Candidate]:
    """Every (strategy, dp, tp, pp, schedule, micro-batches, chunks per rank, checkpointing) with
    ``dp tp pp = ranks``: the micro-batches dividing the batch per dp rank (gradient accumulation
    without a pipeline, at least ``pp`` of them with one); interleaving with every ``v`` (at most
    ``max_interleave``) for which ``pp v`` divides ``layers`` (``v = 2`` without ``layers``)."""
    modes = ["block" if m is True else "none" if m is False else str(m) for m in checkpointing]
    for pp in _divisors(ranks):
        if layers is not None and pp > layers:
            continue
        for tp in _divisors(ranks // pp):
            if max_tp is not None and tp > max_tp:
                continue
            dp = ranks // (pp * tp)
            if global_batch % dp:
                continue
            plans = _schedules(global_batch // dp, pp, schedules, layers, micro_batch, max_interleave)
            for strategy in strategies:
                for sched, m, v in plans:
                    for ckpt in modes:
                        if ckpt == "stage" and (pp == 1 or sched == "zero_bubble"):
                            continue
                        yield Candidate(strategy, dp, tp, pp, sched, m, v, ckpt)  # type: ignore[arg-type]


def _schedules(
    local: int,
    pp: int,
    schedules: tuple[str, ...],
    layers: int | None,
    micro_batch: tuple[int, ...] | None,
    max_interleave: int,
) -> list[tuple[str, int, int]]:
    """Every (schedule, micro-batches, chunks per rank) for ``local`` sequences per dp rank at ``pp``."""
    plans: list[tuple[str, int, int]] = []
    for m in _divisors(local):
        if micro_batch is not None and local // m not in micro_batch:
            continue
        if pp == 1:
            plans.append(("none", m, 1))
            continue
        if m < pp:
            continue
        for sched in schedules:
            if sched != "interleaved_1f1b":
                plans.append((sched, m, 1))
            elif m % pp == 0:
                chunks = [2] if layers is None else [
                    v for v in range(2, max_interleave + 1) if layers % (pp * v) == 0
                ]  # fmt: skip
                plans += [(sched, m, v) for v in chunks]
    return plans


@dataclass(frozen=True)
class Advice:
    """The plans that fit, fastest first, and how many plans were considered."""

    plans: list[Prediction]
    considered: int
    #: why the plans considered do not fit: each reason and how many plans it stopped
    reasons: dict[str, int] = field(default_factory=dict)


def advise(
    spec: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    optimizer: OptimizerSpec | None = None,
    options: StrategyOptions | None = None,
    precision: Precision | None = None,
    strategies: tuple[str, ...] = DP_STRATEGIES,
    checkpointing: tuple[str | bool, ...] = ("none", "block", "stage"),
    runnable_only: bool = False,
    limits: Limits | None = None,
    memo: Memo | None = None,
) -> Advice:
    """Every feasible plan (fits in memory, every size divides), fastest predicted step first
    (ties: least memory). ``memo``: what earlier predictions with the same ``spec``, ``optimizer``,
    ``options`` and ``precision`` computed (:func:`dtlab.advise.predict.predict`'s), reused."""
    batch = integer(global_batch)
    if batch is None or batch < 1:
        raise ArgumentError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    global_batch = batch
    lim = limits or Limits(strategies=strategies, checkpointing=tuple(
        "block" if m is True else "none" if m is False else str(m) for m in checkpointing))  # fmt: skip
    unknown = [s for s in lim.strategies if s not in DP_STRATEGIES]
    if unknown:
        raise ArgumentError(
            f"unknown data-parallel strategies {unknown}; choose from {', '.join(DP_STRATEGIES)}"
        )
    bad = [s for s in lim.schedules if s not in SCHEDULES]
    if bad:
        raise ArgumentError(f"unknown pipeline schedules {bad}; choose from {', '.join(SCHEDULES)}")
    prec = precision or Precision()
    out = []
    considered = 0
    reasons: dict[str, int] = {}
    memo = memo if memo is not None else Memo()
    max_tp = lim.max_tp if lim.max_tp is not None else cluster.ranks_per_node
    for c in candidates(
        cluster.ranks,
        global_batch,
        strategies=lim.strategies,
        schedules=lim.schedules,
        checkpointing=lim.checkpointing,
        layers=spec.layers,
        max_tp=max_tp,
        micro_batch=lim.micro_batch,
        max_interleave=lim.max_interleave,
    ):
        ok = runnable(c, spec, prec)
        if runnable_only and not ok:
            continue
        considered += 1
        p = predict(
            spec,
            cluster,
            c,
            global_batch,
            optimizer=optimizer,
            options=options,
            precision=prec,
            runnable=ok,
            memo=memo,
        )
        if p.fits:
            out.append(p)
        whys = list(p.problems)
        if p.memory.total > cluster.memory_bytes:  # one reason, not one per size ("needs 0.01 GiB > ...")
            whys = [f"more than {cluster.memory_gib:g} GiB per device"] + [
                w for w in whys if not w.startswith("needs ")
            ]
        for why in whys:
            reasons[why] = reasons.get(why, 0) + 1
    out.sort(key=lambda p: (p.step_seconds, p.memory.total, p.candidate.label))
    return Advice(out, considered, reasons)
