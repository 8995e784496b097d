"""One plan's step, rank by rank: tensor parallelism's all-reduces (counted, and on the critical
path), each pipeline rank's compute per micro-batch, and the data-parallel time the step waits for
(formulas: docs/strategies.md, "The formulas", step time)."""

from __future__ import annotations

from dtlab.advise.dataparallel import DataParallelCost, Ops
from dtlab.advise.pipeline import StageShape
from dtlab.advise.spec import Candidate, ClusterSpec, ModelSpec
from dtlab.advise.timing import AXIS_EXTENT, PassTimes, comm_seconds, inside_node, pass_times

__all__ = [
    "add_batch_checks",
    "collective",
    "dp_wait",
    "on_node",
    "rank_times",
    "recomputed_all_reduces",
    "tensor_parallel_ops",
]


def tensor_parallel_ops(
    spec: ModelSpec,
    sequences: int,
    blocks: int,
    first: bool,
    last: bool,
    tp: int,
    e: int = 4,
    checkpointing: str = "none",
) -> Ops:
    """One micro-batch through a stage's tensor-parallel layers: per block 4 all-reduces of ``b s h``
    values (the row-parallel outputs forward, the column-parallel inputs' gradients backward); the
    vocabulary-parallel embedding's output (forward) and the head's input gradient (backward), one
    each; the vocabulary-parallel cross entropy's 3 all-reduces of ``b s`` fp32 values. A
    checkpointed backward reruns forward all-reduces: per block the attention's (torch's
    checkpoint stops recomputing once it has what the backward needs, before the MLP's); per stage
    every forward one but the last block's MLP output (unless the final norm follows it)."""
    if tp == 1:
        return {}
    n = sequences * spec.seq_len
    act = n * spec.hidden * e
    calls = (
        4 * blocks
        + (1 if first else 0)
        + (1 if last else 0)
        + recomputed_all_reduces(blocks, first, last, checkpointing)
    )
    nbytes = calls * (2 * (tp - 1) * act // tp)
    if last:
        calls += 3
        nbytes += 3 * (2 * (tp - 1) * (n * 4) // tp)
    return {"all_reduce": (calls, nbytes)}


def add_batch_checks(ops: Ops, tp: int, steps: int, when: str = "always", *, pipelined: bool = False) -> None:
    """Each ``train_step``'s check that the tp ranks were given one batch: an all-reduce of 6 int64
    (``tp_batch_check="always"``; with "first" or "never" a steady step checks nothing). Under a
    pipeline the check is made over pp x tp instead (every stage learns a refusal), a group that none
    of the axes' counts holds: 6 int64 per step, left out of the per-axis bytes."""
    if tp > 1 and when == "always" and not pipelined:
        calls, nbytes = ops.get("all_reduce", (0, 0))
        ops["all_reduce"] = (calls + steps, nbytes + steps * (2 * (tp - 1) * 48 // tp))


def recomputed_all_reduces(blocks: int, first: bool, last: bool, checkpointing: str) -> int:
    if checkpointing == "block":
        return blocks
    if checkpointing == "stage":
        forward = 2 * blocks + (1 if first else 0)
        return forward if last or forward == 0 else forward - 1
    return 0


def collective(kind: str, calls: int, nbytes_each: int, p: int, intra: bool, cluster: ClusterSpec) -> float:
    return comm_seconds({kind: (calls, calls * nbytes_each)}, p, intra, cluster)


def on_node(axis: str, c: Candidate, cluster: ClusterSpec) -> bool:
    sizes = {"dp": c.dp, "tp": c.tp, "pp": c.pp}
    extent = 1
    for a in AXIS_EXTENT[axis]:
        extent *= sizes[a]
    return inside_node(extent, cluster)


def rank_times(
    spec: ModelSpec, c: Candidate, chunks: list[StageShape], micro: int, e: int, cluster: ClusterSpec
) -> tuple[PassTimes, float, float]:
    """One micro-batch on a pipeline rank: compute with tensor parallelism's all-reduces on the
    critical path (forward ones in ``f``, backward and recomputed ones in ``i``), the compute alone
    (without recomputation) and the all-reduces alone."""
    total = PassTimes()
    compute = tp_time = 0.0
    intra = on_node("tp", c, cluster)
    one = 2 * (c.tp - 1) * (micro * spec.seq_len * spec.hidden * e) // max(c.tp, 1)
    for st in chunks:
        t = pass_times(spec, micro, st.blocks, st.last, c.tp, cluster)
        compute += t.total
        if c.checkpointed:
            t.i += t.f  # the forward again, before the backward
        if c.tp > 1:
            fwd = 2 * st.blocks + (1 if st.first else 0)
            bwd = 2 * st.blocks + (1 if st.last else 0)
            again = recomputed_all_reduces(st.blocks, st.first, st.last, c.checkpointing)
            f = collective("all_reduce", fwd, one, c.tp, intra, cluster)
            b = collective("all_reduce", bwd + again, one, c.tp, intra, cluster)
            if st.last:  # the vocabulary-parallel cross entropy's three small all-reduces
                f += collective("all_reduce", 3, 2 * (c.tp - 1) * micro * spec.seq_len * 4 // c.tp,
                                 c.tp, intra, cluster)  # fmt: skip
            t.f += f
            t.i += b
            tp_time += f + b
        total.add(t)
    return total, compute, tp_time


def dp_wait(cost: DataParallelCost, c: Candidate, t: PassTimes, intra: bool, cluster: ClusterSpec) -> float:
    """The data-parallel time the step waits for. Gradients are reduced bucket by bucket (unit by
    unit) during the last micro-batch's backward: only what outlasts it, and at least the last
    bucket, waits. ZeRO-1/2 gather the updated parameters after the step (nothing to hide behind).
    ZeRO-3/FSDP gather each unit while the one before it computes (prefetch): only gathers
    outlasting the compute wait (under a pipeline: the stage's one gather, behind the first forward)."""
    grad = comm_seconds(cost.grad_ops, c.dp, intra, cluster)
    kind = next(iter(cost.grad_ops), "all_reduce")
    last = collective(kind, 1, cost.last_reduce, c.dp, intra, cluster)
    exposed = max(last, grad - (t.i + t.w))
    gather = comm_seconds(cost.gather_ops, c.dp, intra, cluster)
    if c.strategy in ("zero1", "zero2"):
        exposed += gather
    elif c.strategy in ("zero3", "fsdp"):
        hide = t.f if c.pp > 1 else c.micro_batches * t.total
        exposed += max(0.0, gather - hide)
    return exposed
