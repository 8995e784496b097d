"""One candidate's prediction: memory per rank, bytes per rank per axis and step time.

The formulas are those of docs/strategies.md, section "Choosing a mesh: the cost model": the
data-parallel strategy over the dp axis (``dataparallel.py``), tensor parallelism's all-reduces
over the tp axis, the pipeline's point-to-point messages over the pp axis, the activations
(``activations.py``) and the alpha-beta step time (``timing.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dtlab.advise.activations import Held, stage_activations
from dtlab.advise.dataparallel import DataParallelCost, Ops, data_parallel_cost
from dtlab.advise.layout import Tensor, layout_spec, transformer_model, transformer_tensors
from dtlab.advise.pipeline import StageShape, activation_peak, pipeline_dp_ops, pipeline_ops, split_stages
from dtlab.advise.precision import Precision
from dtlab.advise.spec import Candidate, ClusterSpec, ModelSpec, OptimizerSpec, StrategyOptions
from dtlab.advise.steptime import (
    add_batch_checks,
    collective,
    dp_wait,
    on_node,
    rank_times,
    tensor_parallel_ops,
)
from dtlab.advise.timing import PassTimes, comm_seconds, pipeline_seconds

if TYPE_CHECKING:
    from dtlab.zoo import TransformerLM

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
    (activations of the micro-batches in flight, transient gathered units, gradient buffers and
    compute copies, and the working set a checkpointed backward rebuilds)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int
    recompute: int = 0

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.transient
            + self.recompute
        )


@dataclass(frozen=True)
class AxisCost:
    """What one rank sends over one mesh axis in a step: ``ops`` maps a ``backend.stats`` kind to
    ``(calls, bytes sent)``; ``seconds``: their time on the axis's links, ``exposed``: the part of
    it the step waits for (the rest overlaps compute)."""

    axis: str
    size: int
    inside_node: bool
    ops: Ops
    seconds: float
    exposed: float = 0.0

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
    #: the slowest rank's matrix products and attention in a step (no communication, no idling)
    compute_seconds: float
    #: idle fraction of the schedule (pipeline fill and drain)
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
    #: sequences per micro-batch
    micro_batch: int = 0
    #: how ``dtlab train`` builds the model for this plan (``model.init``'s default): ``meta`` where
    #: the strategy shards the model (ZeRO-3, FSDP, tensor, pipeline), ``plain`` otherwise
    init: str = "plain"
    #: peak host bytes of building the model on the rank that holds the most: ``meta``: its parameter
    #: share plus the largest module made whole; ``plain``: the whole model
    construction: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidate"]["label"] = self.candidate.label
        out["memory"]["total"] = self.memory.total
        for name, axis in self.axes.items():
            out["axes"][name]["bytes_sent"] = axis.bytes_sent
        return out


def problems(spec: ModelSpec, c: Candidate, global_batch: int) -> list[str]:
    """Why the plan cannot run: every rule it breaks, with the values."""
    out = []
    if c.tp > 1:
        if spec.heads % c.tp:
            out.append(f"heads={spec.heads} not divisible by tp={c.tp}")
        if spec.vocab % c.tp:
            out.append(f"vocab={spec.vocab} not divisible by tp={c.tp}")
    stages = c.pp * c.stages_per_rank
    if c.stages_per_rank > 1 and spec.layers % stages:
        out.append(f"layers={spec.layers} not divisible by pp x stages per rank = {stages}")
    elif spec.layers < stages:
        out.append(f"layers={spec.layers} fewer than the {stages} pipeline stages")
    if global_batch % c.dp:
        out.append(f"global batch {global_batch} not divisible by dp={c.dp}")
    else:
        local = global_batch // c.dp
        if local % c.micro_batches:
            out.append(f"batch per dp rank {local} not divisible by micro_batches={c.micro_batches}")
        if c.pp > 1 and c.micro_batches < c.pp:
            out.append(f"micro_batches={c.micro_batches} < pp={c.pp}")
        if c.schedule == "interleaved_1f1b" and c.micro_batches % c.pp:
            out.append(f"interleaved_1f1b needs micro_batches={c.micro_batches} a multiple of pp={c.pp}")
    return out


class Memo:
    """What the plans of one search share (one model, optimizer, options and precision): the
    tensor-parallel layouts, the pipeline splits, each stage's data-parallel cost, activation peak
    and compute times, so a search computes them once per mesh and stage rather than once per plan."""

    def __init__(self) -> None:
        self.layers: dict[tuple[int, bool], list[list[Tensor]]] = {}
        self.stages: dict[tuple[int, int], list[StageShape]] = {}
        self.costs: dict[tuple[object, ...], DataParallelCost] = {}
        self.acts: dict[tuple[object, ...], Held] = {}
        self.times: dict[tuple[object, ...], tuple[PassTimes, float, float]] = {}
        self.cluster: ClusterSpec | None = None  # the one ``times`` holds
        self.model: tuple[ModelSpec, TransformerLM] | None = None  # built once on the meta device
        self.largest: int | None = None  # elements of the largest module's own parameters

    def largest_module(self, spec: ModelSpec) -> int:
        """Elements of the largest single module's own parameters (the model whole)."""
        if self.largest is None:
            sizes: dict[str, int] = {}
            for block in self.tensors_by_block(spec, 1):
                for t in block:
                    sizes[t.module] = sizes.get(t.module, 0) + t.numel
            self.largest = max(sizes.values(), default=0)
        return self.largest

    def timing(self, cluster: ClusterSpec) -> dict[tuple[object, ...], tuple[PassTimes, float, float]]:
        """The compute times for ``cluster`` (those of another cluster are dropped)."""
        if cluster != self.cluster:
            self.times.clear()
            self.cluster = cluster
        return self.times

    def tensors_by_block(self, spec: ModelSpec, tp: int, pipelined: bool = False) -> list[list[Tensor]]:
        """The rank's tensors per pipeline block (0: embedding, ``1..L``: blocks, ``L+1``: head)."""
        key = (tp, pipelined and spec.tied_embeddings)
        if key not in self.layers:
            blocks: list[list[Tensor]] = [[] for _ in range(spec.layers + 2)]
            if self.model is None or self.model[0] != spec:
                self.model = (spec, transformer_model(layout_spec(spec)))
            for t in transformer_tensors(spec, tp, pipelined, self.model[1]):
                blocks[t.layer + 1].append(t)
            self.layers[key] = blocks
        return self.layers[key]

    def split(self, spec: ModelSpec, tp: int, stages: int) -> list[StageShape]:
        if (tp, stages) not in self.stages:
            if stages == 1:
                self.stages[(tp, stages)] = [StageShape(0, 0, spec.layers + 2, spec.layers)]
            else:
                flat = [t for block in self.tensors_by_block(spec, tp, True) for t in block]
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
    precision: Precision | None = None,
    runnable: bool = False,
    memo: Memo | None = None,
) -> Prediction:
    """Memory, bytes per axis and step time of ``candidate`` (``global_batch`` sequences per step).
    ``memo``: shared by calls with the same ``spec``, ``optimizer``, ``options`` and ``precision``."""
    c = candidate
    opt = optimizer or OptimizerSpec()
    opts = options or StrategyOptions()
    prec = precision or Precision()
    memo = memo if memo is not None else Memo()
    bad = problems(spec, c, global_batch)
    if bad:  # sizes that do not split evenly have no meaningful cost
        empty = Memory(0, 0, 0, 0, 0)
        return Prediction(c, empty, 0, {}, 0.0, 0.0, float("inf"), False, tuple(bad), runnable)
    local = global_batch // c.dp
    micro = local // c.micro_batches
    e = prec.activations
    pipelined = c.pp > 1
    blocks = memo.tensors_by_block(spec, c.tp, pipelined)
    stages = memo.split(spec, c.tp, c.pp * c.stages_per_rank)
    passes = 1 if pipelined else c.micro_batches
    stage_mem: list[Memory] = []
    costs: list[DataParallelCost] = []
    tp_ops: list[Ops] = []
    times: list[tuple[PassTimes, float, float]] = []
    for r in range(c.pp):
        mine = [stages[k * c.pp + r] for k in range(c.stages_per_rank)]
        shape = tuple((st.first, st.blocks, st.last) for st in mine)  # what the rank's tensors depend on
        key: tuple[object, ...] = (c.strategy, c.dp, c.tp, pipelined, passes, c.checkpointing, shape)
        if key not in memo.costs:
            held = [t for st in mine for b in range(st.start, st.stop) for t in blocks[b]]
            memo.costs[key] = data_parallel_cost(
                c.strategy,
                held,
                c.dp,
                opts,
                opt,
                prec,
                keep_gathered=pipelined,
                passes=passes,
                recompute=c.checkpointing == "block",
            )
        cost = memo.costs[key]
        akey = (c.schedule, c.pp, c.micro_batches, c.stages_per_rank, c.tp, c.checkpointing, micro, r, shape)
        if akey not in memo.acts:
            if not pipelined:
                memo.acts[akey] = stage_activations(
                    spec, micro, spec.layers, e, tp=c.tp, checkpointing=c.checkpointing
                )
            else:
                memo.acts[akey] = activation_peak(spec, c, r, mine, micro, e)
        acts = memo.acts[akey]
        tkey = (c.tp, c.dp, c.pp, micro, c.checkpointing, shape)
        timed = memo.timing(cluster)
        if tkey not in timed:
            timed[tkey] = rank_times(spec, c, mine, micro, e, cluster)
        times.append(timed[tkey])
        ops: Ops = {}
        for st in mine:
            one = tensor_parallel_ops(spec, micro, st.blocks, st.first, st.last, c.tp, e, c.checkpointing)
            for kind, (calls, nbytes) in one.items():
                prev = ops.get(kind, (0, 0))
                ops[kind] = (prev[0] + calls * c.micro_batches, prev[1] + nbytes * c.micro_batches)
        add_batch_checks(ops, c.tp, passes, opts.tp_batch_check, pipelined=pipelined)
        costs.append(cost)
        tp_ops.append(ops)
        stage_mem.append(Memory(cost.parameters, cost.gradients, cost.optimizer_state, acts.kept,
                                cost.transient, acts.rebuilt))  # fmt: skip
    worst = max(range(c.pp), key=lambda r: stage_mem[r].total)
    tied = 0
    if spec.tied_embeddings and pipelined:
        tied = (spec.vocab // c.tp) * spec.hidden * prec.reduce  # 2 ranks: an all-reduce sends it all
    stage_ops = tuple(
        {
            "dp": pipeline_dp_ops(c, costs[r].ops, find_unused_parameters=opts.find_unused_parameters),
            "tp": tp_ops[r],
            "pp": pipeline_ops(spec, c, r, micro, e, tied),
        }
        for r in range(c.pp)
    )
    per_axis: dict[str, Ops] = {
        axis: max((o[axis] for o in stage_ops), key=lambda o: sum(b for _, b in o.values()))
        for axis in ("dp", "tp", "pp")
    }
    slow = max(range(c.pp), key=lambda r: times[r][0].total)
    per_micro, compute_one, tp_one = times[slow]
    body = pipeline_seconds(c.schedule, c.pp, c.micro_batches, c.stages_per_rank, per_micro)
    busy = c.micro_batches * per_micro.total
    exposed = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    if c.tp > 1:
        exposed["tp"] = c.micro_batches * tp_one
    dp_intra, pp_intra = on_node("dp", c, cluster), on_node("pp", c, cluster)
    if c.dp > 1:
        exposed["dp"] = max(dp_wait(costs[r], c, times[r][0], dp_intra, cluster) for r in range(c.pp))
    if pipelined:
        msg = micro * spec.seq_len * spec.hidden * e
        hops = 2 * (c.pp * c.stages_per_rank - 1)  # first forward, last backward: every boundary
        exposed["pp"] = collective("send", hops, msg, c.pp, pp_intra, cluster)
        if tied:
            exposed["pp"] += collective("all_reduce", 1, tied, 2, pp_intra, cluster)
    axes: dict[str, AxisCost] = {}
    sizes = {"dp": c.dp, "tp": c.tp, "pp": c.pp}
    for axis, ops in per_axis.items():
        intra = on_node(axis, c, cluster)
        seconds = comm_seconds(ops, sizes[axis], intra, cluster)
        axes[axis] = AxisCost(axis, sizes[axis], intra, ops, seconds, exposed[axis])
    step = body + exposed["dp"] + exposed["pp"]
    memory = stage_mem[worst]
    meta = c.strategy in ("zero3", "fsdp") or c.tp > 1 or pipelined
    share = max(m.parameters for m in stage_mem)
    build = share + memo.largest_module(spec) * prec.params if meta else spec.parameters * prec.params
    out_of_memory = memory.total > cluster.memory_bytes
    notes = [f"needs {memory.total / 2**30:.2f} GiB > {cluster.memory_gib:g} GiB"] if out_of_memory else []
    return Prediction(
        candidate=c,
        memory=memory,
        peak_gathered_parameters=costs[worst].peak_gathered_parameters,
        axes=axes,
        compute_seconds=c.micro_batches * compute_one,
        bubble=1.0 - busy / body if body > 0 else 0.0,
        step_seconds=step,
        fits=not out_of_memory,
        problems=tuple(notes),
        runnable=runnable,
        stage_memory=tuple(stage_mem),
        stage_ops=stage_ops,
        micro_batch=micro,
        init="meta" if meta else "plain",
        construction=build,
    )
