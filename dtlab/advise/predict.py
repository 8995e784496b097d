"""One candidate's prediction: memory per rank, bytes per rank per axis and step time.

The formulas are those of docs/strategies.md, section "Choosing a mesh: the cost model": the
data-parallel strategy over the dp axis (``dataparallel.py``), tensor parallelism's all-reduces
over the tp axis, the pipeline's point-to-point messages over the pp axis, the activations
(``activations.py``) and the alpha-beta step time (``timing.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dtlab.advise.activations import activation_bytes
from dtlab.advise.dataparallel import DataParallelCost, Ops, data_parallel_cost
from dtlab.advise.layout import Tensor, transformer_tensors
from dtlab.advise.pipeline import StageShape, activation_peak, pipeline_ops, split_stages
from dtlab.advise.spec import Candidate, ClusterSpec, ModelSpec, OptimizerSpec, StrategyOptions
from dtlab.advise.timing import AXIS_EXTENT, bubble, comm_seconds, inside_node

__all__ = [
    "AxisCost",
    "Memo",
    "Memory",
    "Prediction",
    "predict",
    "problems",
    "tensor_parallel_ops",
]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds: after a step (parameters, gradients, optimizer state) and during one
    (activations of the micro-batches in flight, transient gathered units and gradient buffers)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.transient


@dataclass(frozen=True)
class AxisCost:
    """What one rank sends over one mesh axis in a step: ``ops`` maps a ``backend.stats`` kind to
    ``(calls, bytes sent)``."""

    axis: str
    size: int
    inside_node: bool
    ops: Ops
    seconds: float

    @property
    def bytes_sent(self) -> int:
        return sum(b for k, (_, b) in self.ops.items() if k != "recv")


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    #: the pipeline rank with the most memory (every rank when pp = 1)
    memory: Memory
    peak_gathered_parameters: int
    axes: dict[str, AxisCost]
    compute_seconds: float
    bubble: float
    step_seconds: float
    fits: bool
    problems: tuple[str, ...]
    #: whether dtlab has a model strategy for this plan today (see ``dtlab.core.pairs``)
    runnable: bool = False
    #: the memory of every pipeline rank, first stage first
    stage_memory: tuple[Memory, ...] = field(default_factory=tuple)
    #: what every pipeline rank sends per axis (``axes`` holds the rank that sends most)
    stage_ops: tuple[dict[str, Ops], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidate"]["label"] = self.candidate.label
        out["memory"]["total"] = self.memory.total
        for name, axis in self.axes.items():
            out["axes"][name]["bytes_sent"] = axis.bytes_sent
        return out


def tensor_parallel_ops(
    spec: ModelSpec, sequences: int, blocks: int, first: bool, last: bool, tp: int
) -> Ops:
    """One micro-batch through a stage's tensor-parallel layers: per block 4 all-reduces of ``b s h``
    (the row-parallel outputs forward, the column-parallel inputs' gradients backward); the
    vocabulary-parallel embedding's output (forward) and the head's input gradient (backward), one
    each; the vocabulary-parallel cross entropy's 3 all-reduces of ``b s`` fp32 values."""
    if tp == 1:
        return {}
    n = sequences * spec.seq_len
    act = n * spec.hidden * spec.dtype_bytes
    calls = 4 * blocks + (1 if first else 0) + (1 if last else 0)
    nbytes = calls * (2 * (tp - 1) * act // tp)
    if last:
        calls += 3
        nbytes += 3 * (2 * (tp - 1) * (n * 4) // tp)
    return {"all_reduce": (calls, nbytes)}


def problems(spec: ModelSpec, c: Candidate, global_batch: int) -> list[str]:
    """Why the plan cannot run: every rule it breaks, with the values."""
    out = []
    if c.tp > 1:
        if spec.heads % c.tp:
            out.append(f"heads={spec.heads} not divisible by tp={c.tp}")
        if spec.vocab % c.tp:
            out.append(f"vocab={spec.vocab} not divisible by tp={c.tp}")
    stages = c.pp * c.stages_per_rank
    if spec.layers % stages:
        out.append(f"layers={spec.layers} not divisible by pp x stages per rank = {stages}")
    if global_batch % c.dp:
        out.append(f"global batch {global_batch} not divisible by dp={c.dp}")
    elif c.pp > 1:
        local = global_batch // c.dp
        if local % c.micro_batches:
            out.append(f"batch per dp rank {local} not divisible by micro_batches={c.micro_batches}")
        if c.micro_batches < c.pp:
            out.append(f"micro_batches={c.micro_batches} < pp={c.pp}")
        if c.schedule == "interleaved_1f1b" and c.micro_batches % c.pp:
            out.append(f"interleaved_1f1b needs micro_batches={c.micro_batches} a multiple of pp={c.pp}")
    return out


def _memory(cost: DataParallelCost, activations: int) -> Memory:
    return Memory(cost.parameters, cost.gradients, cost.optimizer_state, activations, cost.transient)


class Memo:
    """What the plans of one search share (one model, optimizer and options): the tensor-parallel
    layouts, the pipeline splits, each stage's data-parallel cost and activation peak, so a search
    computes them once per mesh and stage rather than once per plan."""

    def __init__(self) -> None:
        self.layers: dict[int, list[list[Tensor]]] = {}
        self.stages: dict[tuple[int, int], list[StageShape]] = {}
        self.costs: dict[tuple[object, ...], DataParallelCost] = {}
        self.acts: dict[tuple[object, ...], int] = {}

    def tensors_by_block(self, spec: ModelSpec, tp: int) -> list[list[Tensor]]:
        """The rank's tensors per pipeline block (0: embedding, ``1..L``: blocks, ``L+1``: head)."""
        if tp not in self.layers:
            blocks: list[list[Tensor]] = [[] for _ in range(spec.layers + 2)]
            for t in transformer_tensors(spec, tp):
                blocks[t.layer + 1].append(t)
            self.layers[tp] = blocks
        return self.layers[tp]

    def split(self, spec: ModelSpec, tp: int, stages: int) -> list[StageShape]:
        if (tp, stages) not in self.stages:
            if stages == 1:
                self.stages[(tp, stages)] = [StageShape(0, 0, spec.layers + 2, spec.layers)]
            else:
                flat = [t for block in self.tensors_by_block(spec, tp) for t in block]
                self.stages[(tp, stages)] = split_stages(spec, flat, stages)
        return self.stages[(tp, stages)]


def predict(
    spec: ModelSpec,
    cluster: ClusterSpec,
    candidate: Candidate,
    global_batch: int,
    *,
    optimizer: OptimizerSpec | None = None,
    options: StrategyOptions | None = None,
    runnable: bool = False,
    memo: Memo | None = None,
) -> Prediction:
    """Memory, bytes per axis and step time of ``candidate`` (``global_batch`` sequences per step).
    ``memo``: shared by the calls of one search (same ``spec``, ``optimizer`` and ``options``)."""
    c = candidate
    opt = optimizer or OptimizerSpec()
    opts = options or StrategyOptions()
    memo = memo if memo is not None else Memo()
    bad = problems(spec, c, global_batch)
    if bad:  # sizes that do not split evenly have no meaningful cost
        empty = Memory(0, 0, 0, 0, 0)
        return Prediction(c, empty, 0, {}, 0.0, 0.0, float("inf"), False, tuple(bad), runnable)
    local = global_batch // c.dp
    micro = local // c.micro_batches
    blocks = memo.tensors_by_block(spec, c.tp)
    stages = memo.split(spec, c.tp, c.pp * c.stages_per_rank)
    stage_mem: list[Memory] = []
    costs: list[DataParallelCost] = []
    tp_ops: list[Ops] = []
    for r in range(c.pp):
        mine = [stages[k * c.pp + r] for k in range(c.stages_per_rank)]
        shape = tuple((st.first, st.blocks, st.last) for st in mine)  # what the rank's tensors depend on
        key: tuple[object, ...] = (c.strategy, c.dp, c.tp, c.pp > 1, shape)
        if key not in memo.costs:
            held = [t for st in mine for b in range(st.start, st.stop) for t in blocks[b]]
            memo.costs[key] = data_parallel_cost(
                c.strategy, held, c.dp, opts, opt, spec.dtype_bytes, keep_gathered=c.pp > 1
            )
        cost = memo.costs[key]
        akey = (c.schedule, c.pp, c.micro_batches, c.stages_per_rank, c.tp, c.checkpointing, micro, r, shape)
        if akey not in memo.acts:
            if c.pp == 1:
                memo.acts[akey] = activation_bytes(
                    spec, micro, spec.layers, tp=c.tp, checkpointing=c.checkpointing
                )
            else:
                memo.acts[akey] = activation_peak(spec, c, r, mine, micro)
        acts = memo.acts[akey]
        ops: Ops = {}
        for st in mine:
            one = tensor_parallel_ops(spec, micro, st.blocks, st.first, st.last, c.tp)
            for kind, (calls, nbytes) in one.items():
                prev = ops.get(kind, (0, 0))
                ops[kind] = (prev[0] + calls * c.micro_batches, prev[1] + nbytes * c.micro_batches)
        costs.append(cost)
        tp_ops.append(ops)
        stage_mem.append(_memory(cost, acts))
    worst = max(range(c.pp), key=lambda r: stage_mem[r].total)
    sizes = {"dp": c.dp, "tp": c.tp, "pp": c.pp}
    stage_ops = tuple(
        {"dp": costs[r].ops, "tp": tp_ops[r], "pp": pipeline_ops(spec, c, r, micro)} for r in range(c.pp)
    )
    per_axis: dict[str, Ops] = {
        axis: max((o[axis] for o in stage_ops), key=lambda o: sum(b for _, b in o.values()))
        for axis in ("dp", "tp", "pp")
    }
    axes: dict[str, AxisCost] = {}
    for axis, ops in per_axis.items():
        extent = 1
        for a in AXIS_EXTENT[axis]:
            extent *= sizes[a]
        intra = inside_node(extent, cluster)
        axes[axis] = AxisCost(axis, sizes[axis], intra, ops, comm_seconds(ops, sizes[axis], intra, cluster))
    flops = global_batch * spec.seq_len * spec.flops_per_token() * (4 if c.checkpointing else 3)
    compute = flops / (c.ranks * cluster.tflops * 1e12)
    idle = bubble(c.schedule, c.pp, c.micro_batches, c.stages_per_rank)
    step = compute / (1.0 - idle) + sum(a.seconds for a in axes.values())
    memory = stage_mem[worst]
    out_of_memory = memory.total > cluster.memory_bytes
    notes = [f"needs {memory.total / 2**30:.2f} GiB > {cluster.memory_gib:g} GiB"] if out_of_memory else []
    return Prediction(
        candidate=c,
        memory=memory,
        peak_gathered_parameters=costs[worst].peak_gathered_parameters,
        axes=axes,
        compute_seconds=compute,
        bubble=idle,
        step_seconds=step,
        fits=not out_of_memory,
        problems=tuple(notes),
        runnable=runnable,
        stage_memory=tuple(stage_mem),
        stage_ops=stage_ops,
    )
