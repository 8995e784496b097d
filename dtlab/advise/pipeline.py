"""A pipeline rank's share: its stages (``PipelineParallelModel``'s balanced split), the activations it
holds at its peak under each schedule, and the messages it sends.

Stages are cut between the model's pipeline blocks (``TransformerLM.pipeline_blocks()``: the
embedding, each transformer block, the final norm with the head) by dtlab's own
``balanced_split`` of their parameter counts; stage ``s`` runs on rank ``s % pp``.

Activations per micro-batch and stage, as ``PipelineParallelModel`` counts them (its
``memory_report()["activations"]``): what autograd saves in the stage's forward (parameters and the
batch left out), plus the stage's output (``b s h`` values; the last stage's is the 4-byte loss),
held from the forward until the backward. Under zero-bubble the backward's ``I`` keeps, until its
``W``, the inputs and output-gradients of the stage's linear layers (``16 h`` values per token per
block, ``h + V/t`` for the head). The peak is replayed along the rank's compute order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dtlab.advise.activations import Held, stage_activations
from dtlab.advise.layout import Tensor
from dtlab.advise.spec import Candidate, ModelSpec
from dtlab.models.pipeline._schedules import compute_order
from dtlab.models.pipeline._split import balanced_split

__all__ = ["StageShape", "activation_peak", "pipeline_dp_ops", "pipeline_ops", "split_stages"]


@dataclass(frozen=True)
class StageShape:
    """One stage: its pipeline blocks' range (0: embedding, ``1..L``: blocks, ``L+1``: head)."""

    index: int
    start: int
    stop: int
    layers: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.layers + 2

    @property
    def blocks(self) -> int:
        """Transformer blocks in the stage."""
        return min(self.stop, self.layers + 1) - max(self.start, 1)

    def holds(self, t: Tensor) -> bool:
        return self.start <= t.layer + 1 < self.stop


def split_stages(spec: ModelSpec, tensors: Sequence[Tensor], stages: int) -> list[StageShape]:
    """The stages ``PipelineParallelModel`` cuts by default (balanced by parameters per block)."""
    sizes = [0] * (spec.layers + 2)
    for t in tensors:
        sizes[t.layer + 1] += t.numel
    starts = balanced_split(sizes, stages)
    ends = [*starts[1:], spec.layers + 2]
    return [StageShape(i, a, b, spec.layers) for i, (a, b) in enumerate(zip(starts, ends, strict=True))]


def _held(spec: ModelSpec, stage: StageShape, sequences: int, c: Candidate, e: int) -> tuple[Held, int]:
    """What one micro-batch keeps on ``stage`` from its forward to its backward (and the working set
    its checkpointed backward rebuilds), and (zero-bubble) what it keeps from its ``I`` to its ``W``."""
    n = sequences * spec.seq_len
    held = stage_activations(
        spec,
        sequences,
        stage.blocks,
        e,
        first=stage.first,
        last=stage.last,
        tp=c.tp,
        checkpointing=c.checkpointing,
        pipelined=True,
    )
    weights = stage.blocks * 16 * n * spec.hidden * e
    if stage.last:
        weights += n * (spec.hidden + spec.vocab // c.tp) * e
    return held, weights


def _order(c: Candidate, rank: int) -> list[tuple[str, int, int]]:
    """This rank's compute order ``(kind, chunk, micro)``: the schedule's own generator, unchecked."""
    ops = compute_order(c.schedule, c.pp, c.micro_batches, c.stages_per_rank, rank)
    return [(a.kind.value, a.stage // c.pp, a.micro) for a in ops]


def _steady(c: Candidate) -> Candidate:
    """The same schedule with fewer micro-batches but the same peak: past its warm-up, interleaved
    1F1B repeats every ``p v`` steps and ZB-H1 every step (each period ends where it began), and
    the drain only releases; so ``p (v + 3)`` (interleaved) or ``p + 3`` micro-batches reach it."""
    cap = c.pp * (c.stages_per_rank + 3) if c.schedule == "interleaved_1f1b" else c.pp + 3
    return c if c.micro_batches <= cap else replace(c, micro_batches=cap)


def activation_peak(
    spec: ModelSpec,
    c: Candidate,
    rank: int,
    chunks: Sequence[StageShape],
    sequences: int,
    e: int,
    *,
    shortcut: bool = True,
) -> Held:
    """The most activation bytes ``rank`` keeps at once during a step (its ``chunks``: its stages),
    and the largest working set a checkpointed backward rebuilds on it (once at a time).
    ``shortcut``: replay a steady prefix of the schedule (:func:`_steady`), not all of it."""
    sizes = [_held(spec, s, sequences, c, e) for s in chunks]
    rebuilt = max(h.rebuilt for h, _ in sizes)
    if c.schedule in ("gpipe", "1f1b"):  # one chunk, every micro-batch alike: no replay needed
        n = c.micro_batches if c.schedule == "gpipe" else min(c.pp - rank, c.micro_batches)
        return Held(n * sizes[0][0].kept, rebuilt)
    held = peak = 0
    for kind, chunk, _ in _order(_steady(c) if shortcut else c, rank):
        full, weights = sizes[chunk][0].kept, sizes[chunk][1]
        held += {"F": full, "B": -full, "I": weights - full, "W": -weights}[kind]
        peak = max(peak, held)
    return Held(peak, rebuilt)


def pipeline_ops(
    spec: ModelSpec, c: Candidate, rank: int, sequences: int, e: int, tied: int = 0
) -> dict[str, tuple[int, int]]:
    """What ``rank`` sends over the pp axis in a step: every stage it holds but the last sends its output
    forward, every one but the first its input-gradient back, once per micro-batch (``b s h`` values
    of ``e`` bytes each); then one all-reduce over pp of ``1 + p`` float32 values (the last stage's
    loss and each rank's count of parameters no micro-batch used, refused if any). ``tied``: bytes of a
    tied embedding's gradient, which the first and the last rank sum with one all-reduce between the
    two of them (Megatron-LM's embedding group)."""
    p, v, m = c.pp, c.stages_per_rank, c.micro_batches
    if p == 1:
        return {}
    stages = [k * p + rank for k in range(v)]
    last = p * v - 1
    msgs = m * (sum(1 for s in stages if s < last) + sum(1 for s in stages if s > 0))
    size = sequences * spec.seq_len * spec.hidden * e
    root = last % p
    counted = 2 * (p - 1) * 4 * (1 + p) // p  # an all-reduce of n bytes counts 2 (p - 1) n / p
    out = {"send": (msgs, msgs * size), "all_reduce": (1, counted)}
    if tied and rank in (0, root):
        out["all_reduce"] = (2, counted + tied)
    return out


def pipeline_dp_ops(
    c: Candidate, dp_ops: dict[str, tuple[int, int]], *, find_unused_parameters: bool = False
) -> dict[str, tuple[int, int]]:
    """``dp_ops`` (what a stage's data-parallel strategy sends over dp in a step) with a pipelined step's
    check that no replica holds a parameter no micro-batch used: one all-reduce over dp of ``dp x pp``
    float32 values (every replica's counts) after the loss's over pp, at ``dp > 1``; with
    ``find_unused_parameters`` (such parameters are left out of the step instead) one of one float32
    instead (whether every replica's loss had no graph)."""
    if c.pp == 1 or c.dp == 1:
        return dp_ops
    calls, nbytes = dp_ops.get("all_reduce", (0, 0))
    values = 1 if find_unused_parameters else c.dp * c.pp
    counted = 2 * (c.dp - 1) * 4 * values // c.dp  # an all-reduce of n bytes counts 2 (p - 1) n / p
    return {**dp_ops, "all_reduce": (calls + 1, nbytes + counted)}
