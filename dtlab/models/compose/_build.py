"""How the composition is laid out on a rank, in torchtitan's order, before the data-parallel strategy
wraps it: the mesh rule, the tensor plan applied, the model split into pipeline stages with other
ranks' stages released to the meta device (this rank's under the whole model's names:
:class:`StageRoot`), and what is recorded while every tensor is still whole.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import Mesh, MeshLike
from dtlab.core import pairs
from dtlab.core.placement import Placement, placement_of
from dtlab.core.plan import check_schedule_args
from dtlab.core.shard_index import full_shape_of
from dtlab.core.torch_private import non_persistent_buffers
from dtlab.errors import ArgumentTypeError, StrategyError, check_switches
from dtlab.models.compose._tied import swap_layers, tied_groups
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.ddp import DDPModel
from dtlab.models.dp.flat import check_real
from dtlab.models.dp.fsdp import FSDPModel
from dtlab.models.dp.zero1 import ZeRO1Model
from dtlab.models.dp.zero2 import ZeRO2Model
from dtlab.models.dp.zero3 import ZeRO3Model
from dtlab.models.pipeline._runtime import check_stage_checkpointing
from dtlab.models.pipeline._schedules import PipelineSchedule, build_schedule
from dtlab.models.pipeline._split import (
    Shapes,
    Stage,
    every_child,
    has_blocks,
    module_blocks,
    split_blocks,
    stage_shapes,
)
from dtlab.models.pipeline._ties import CrossTie, cross_ties, init_ties
from dtlab.models.pipeline._trace import TracedStage, traced_stages
from dtlab.models.tensor._plan import Plan

__all__ = [
    "AXES",
    "DATA_PARALLEL_CLASSES",
    "Entries",
    "Layout",
    "PipelineArgs",
    "StageRoot",
    "as_mesh",
    "data_parallel_choice",
    "lay_out",
]

#: the data-parallel strategies the dp axis can run, by name
DATA_PARALLEL_CLASSES: dict[str, type[DataParallelModel]] = {
    "ddp": DDPModel,
    "zero1": ZeRO1Model,
    "zero2": ZeRO2Model,
    "zero3": ZeRO3Model,
    "fsdp": FSDPModel,
}
AXES = ("pp", "dp", "tp")


#: torch.distributed.pipelining's arguments (ScheduleGPipe / Schedule1F1B, pipeline()) and their place here
_TORCH_PIPELINING = {
    "n_microbatches": "pass micro_batches= (the batch must split into that many equal micro-batches)",
    "loss_fn": "pass it to each step: model.train_step((inputs, targets), loss_fn)",
    "scale_grads": (
        "train_step always divides each micro-batch's loss by micro_batches (torch's scale_grads=True), "
        "so a mean loss gives one process's gradients; for other scaling, scale the loss in loss_fn"
    ),
    "split_spec": "pass split_points=[the names of the blocks where stages 1.. begin]",
}


def data_parallel_choice(
    who: str, data_parallel: object, kwargs: Mapping[str, Any]
) -> tuple[type[DataParallelModel], dict[str, Any], Any]:
    """The strategy class ``data_parallel`` names (anything else raises, naming the choices), its
    options as its constructor takes them (ZeRO-1 all-reduces unless told) and the ``gradient_sync``
    chosen (ZeRO-1; ``None``: the optimizer's choice)."""
    for name, fix in _TORCH_PIPELINING.items():  # else the dp strategy names itself, and no fix
        if name in kwargs:
            raise ArgumentTypeError(
                f"{who}({name}=...): torch.distributed.pipelining's {name}= is not an option here; {fix}"
            )
    dp_class = DATA_PARALLEL_CLASSES.get(data_parallel) if isinstance(data_parallel, str) else None
    if dp_class is None:
        choices = ", ".join(pairs.DATA_PARALLEL)
        raise StrategyError(f"{who}(data_parallel={data_parallel!r}): choose one of {choices}")
    options = dict(kwargs)
    chosen_sync = options.get("gradient_sync") if data_parallel == "zero1" else None
    if data_parallel == "zero1":
        options["gradient_sync"] = chosen_sync or "all_reduce"
    return dp_class, options, chosen_sync


def as_mesh(
    mesh: MeshLike | CommunicationBackend, who: str, axis: str | None, axes: Sequence[str]
) -> MeshLike:
    """The one mesh rule of the model-parallel strategies: a :class:`~dtlab.backends.MeshLike` whose axes
    of size > 1 are among ``axes`` (and which has ``axis``, the strategy's own, when given); a plain
    backend stands for a mesh of that one axis."""
    if isinstance(mesh, CommunicationBackend) and axis is not None:
        mesh = Mesh(mesh, {axis: mesh.world_size})
    if not isinstance(mesh, MeshLike):
        raise TypeError(
            f"{who} takes a dtlab.backends.Mesh (or a MeshLike), got {type(mesh).__name__}; e.g. "
            "Mesh(backend, {'pp': 2, 'dp': -1, 'tp': 2})"
        )
    if axis is not None and axis not in mesh.axis_names:
        raise StrategyError(
            f"{who} needs a mesh with a {axis!r} axis, got axes {list(mesh.axis_names)}; e.g. "
            f"Mesh(backend, {{'dp': -1, {axis!r}: 2}})"
        )
    others = [f"{a}={mesh.size(a)}" for a in mesh.axis_names if a not in axes and mesh.size(a) > 1]
    if others:
        composed = "" if tuple(axes) == AXES else " (HybridShardedModel composes pp, dp and tp)"
        raise StrategyError(
            f"{who} runs on the mesh axes {', '.join(axes)}; this mesh also has {others}{composed}"
        )
    return mesh


Entries = dict[str, tuple[list[int], torch.dtype, int, Placement]]


def tensor_entries(module: nn.Module, tp: int, owner: dict[int, int], by_module: dict[int, int]) -> Entries:
    """Every tensor of the whole model: full shape, dtype, the pipeline rank holding it (``by_module``:
    the rank running the module it is named under, which a tied parameter's name follows; else
    ``owner``: the rank of the first stage holding the tensor; else 0), placement."""
    out: Entries = {}
    for key, t in module.state_dict(keep_vars=True).items():
        rank = by_module.get(id(module.get_submodule(key.rpartition(".")[0])), owner.get(id(t), 0))
        out[key] = (full_shape_of(t.shape, placement_of(t), tp), t.dtype, rank, placement_of(t))
    return out


@dataclass(frozen=True)
class PipelineArgs:
    """The pipeline's arguments as the user gave them (checked by :func:`lay_out`)."""

    schedule: str = "1f1b"
    micro_batches: int | None = None
    split_points: Sequence[str] | None = None
    stages_per_rank: int = 1
    activation_checkpointing: bool = False


@dataclass
class Layout:
    """This rank's part of the composition, ready for the data-parallel strategy."""

    root: nn.Module  #: what the data-parallel strategy wraps (the module, or this rank's StageRoot)
    stages: list[Stage | TracedStage]  #: every stage in order (empty without a pipeline)
    shapes: list[Shapes]  #: each stage's tensors' shapes, recorded while whole
    schedule: PipelineSchedule | None
    micro_batches: int
    entries: Entries  #: every tensor of the whole model
    partial: set[str]  #: names (in ``root``) of the sequence-parallel parameters with partial gradients
    #: each parameter the tensor plan replaced (by id) -> the tensor-parallel parameter replacing it
    swapped: dict[int, torch.Tensor]
    #: a model split at module names: every tensor's shape by name (for the meta trace), else empty
    whole_shapes: Shapes = field(default_factory=dict)
    ties: list[CrossTie] = field(default_factory=list)  #: parameters tied across pipeline ranks
    aliases: dict[str, str] = field(default_factory=dict)  #: a tied parameter's other names -> its first
    unwritten: set[str] = field(default_factory=set)  #: names in ``root`` another rank's checkpoint writes

    @property
    def traced(self) -> bool:
        return bool(self.stages) and isinstance(self.stages[0], TracedStage)


def _check_pipeline(who: str, args: PipelineArgs, p: int, m: int, pipelined: bool) -> None:
    """Every pipeline check before any work, with the rule and the values."""
    check_switches(who, activation_checkpointing=args.activation_checkpointing)
    if not pipelined and args.schedule not in pairs.SCHEDULES:  # unused here, but a typo is named
        check_schedule_args(args.schedule, p, m)
    if pipelined:
        check_stage_checkpointing(args.activation_checkpointing, args.schedule, who)
        check_schedule_args(args.schedule, p, m, args.stages_per_rank)
    elif args.activation_checkpointing:
        raise StrategyError(
            f"{who}(activation_checkpointing=True) checkpoints pipeline stages; without a pipeline "
            "checkpoint blocks instead: dtlab.models.checkpointing.checkpoint_modules(module, "
            "(YourBlock,)) before wrapping"
        )
    elif args.split_points:
        raise StrategyError(
            f"split_points={list(args.split_points)} need a pipeline (pp > 1 or stages_per_rank > 1)"
        )


def _check_uncompiled(who: str, module: nn.Module) -> None:
    """Refuse ``torch.compile(model)``'s wrapper where modules are found by name (a tensor plan, split
    points): its modules are named ``_orig_mod...``, and the plan or the split would swap layers behind it."""
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if compiled is not None and isinstance(module, compiled):
        raise StrategyError(
            f"{who}: the module is torch.compile(model)'s wrapper (OptimizedModule), whose modules are "
            "named '_orig_mod.<name>': the tensor plan and the pipeline split find the model's layers by "
            "their names. Wrap the plain model, then compile: the wrapper (torch.compile(model), without a "
            "pipeline), or the model in place before wrapping (hf_model.compile(); under a pipeline each "
            "block, layer.compile()), which keeps the names"
        )


def lay_out(
    who: str,
    module: nn.Module,
    mesh: MeshLike,
    tensor_plan: Plan | None,
    args: PipelineArgs,
    always_pipelined: bool,
    on_meta: bool = False,
) -> Layout:
    """1. the tensor plan (every stage's layers, before the split), 2. the pipeline stages (a pipeline
    runs when pp > 1, stages_per_rank > 1 or micro_batches > 1, or always when asked). ``on_meta``: the
    module is on the meta device (no values to broadcast; the layers are swapped on meta)."""
    tp, pp = mesh["tp"], mesh["pp"]
    p, v = pp.world_size, args.stages_per_rank
    m = p if args.micro_batches is None else args.micro_batches
    pipelined = always_pipelined or p > 1 or v > 1 or m > 1
    _check_pipeline(who, args, p, m, pipelined)
    if tensor_plan is not None or pipelined:
        _check_uncompiled(who, module)
    if tp.world_size * p > 1:  # the dp strategy checks its own group
        check_real(who, [(n, q) for n, q in module.named_parameters() if q.requires_grad])
    partial: list[nn.Parameter] = []
    swapped: dict[int, torch.Tensor] = {}
    if tensor_plan is not None:
        partial, swapped = swap_layers(who, module, tensor_plan, tp, broadcast=not on_meta)
    elif tp.world_size > 1:
        raise StrategyError(
            f"{who} on a mesh with tp={tp.world_size} needs a tensor_plan: 'auto' for the plan the module "
            "declares (its tp_plan() method, Hugging Face's _tp_plan), or {'fqn-pattern': style}"
        )
    if not pipelined:
        entries = tensor_entries(module, tp.world_size, {}, {})
        return Layout(module, [], [], None, m, entries, _names(module, partial), swapped)
    stages = split_stages(who, module, p * v, args.split_points)
    schedule = build_schedule(args.schedule, p, m, v)  # dry-run: no deadlock, every message matched
    owner: dict[int, int] = {}
    by_module: dict[int, int] = {}  # every module of a stage -> the pipeline rank running it (its first)
    holders: dict[int, set[int]] = {}  # every parameter of a stage -> the pipeline ranks holding it
    for s, st in enumerate(stages):
        for t in [*st.parameters(), *st.buffers()]:
            owner.setdefault(id(t), schedule.rank_of(s))  # a replicated buffer: saved by its first stage
        for q in st.parameters():
            holders.setdefault(id(q), set()).add(schedule.rank_of(s))
        for sub in st.modules():
            by_module.setdefault(id(sub), schedule.rank_of(s))
    groups = tied_groups(module)
    crossing = cross_ties(module, holders)
    init_ties(crossing, module, pp, on_meta)  # collective over pp: the copies start equal
    entries = tensor_entries(module, tp.world_size, owner, by_module)  # before other stages become meta
    shapes = [stage_shapes(stage) for stage in stages]
    whole = stage_shapes(module, remove_duplicate=False) if isinstance(stages[0], TracedStage) else {}
    mine = schedule.stages_of(pp.rank)
    _release(stages, mine)
    root = StageRoot(module, {s: stages[s] for s in mine})
    if not any(q.requires_grad for q in root.parameters()):
        raise StrategyError(
            f"pipeline rank {pp.rank} holds stages {list(mine)} with no trainable parameters; move the "
            "split points so every rank has some"
        )
    aliases = {n: names[0] for names in groups for n in names[1:]}  # other name -> first name
    unwritten = {k for k in root.state_dict(keep_vars=True) if k in aliases or entries[k][2] != pp.rank}
    names = _names(root, partial)
    return Layout(
        root, stages, shapes, schedule, m, entries, names, swapped, whole, crossing, aliases, unwritten
    )


def _names(root: nn.Module, params: list[nn.Parameter]) -> set[str]:
    wanted = {id(q) for q in params if q.requires_grad}
    return {n for n, q in root.named_parameters() if id(q) in wanted}


def split_stages(
    who: str, module: nn.Module, n: int, split_points: Sequence[str] | None
) -> list[Stage | TracedStage]:
    """``n`` stages: at block names of an ``nn.Sequential`` or a module with ``pipeline_blocks()``, else
    at module names (``split_points`` required), each stage running the model's own forward."""
    if has_blocks(module):
        return list(split_blocks(module_blocks(module), n, split_points))
    if not split_points:
        children = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
        own = f", or one of its children with parameters {children}" if children else ""
        raise StrategyError(
            f"{who}: {type(module).__name__} has no pipeline_blocks() and is no nn.Sequential; name the "
            f"module where each of stages 1..{n - 1} begins: split_points=[{n - 1} module name(s)] "
            f"(dtlab train: parallel.split_points), e.g. a decoder layer such as 'model.layers.2'{own}; or "
            "give the model a pipeline_blocks() method"
        )
    return list(traced_stages(module, split_points, n))


def _release(stages: Sequence[nn.Module], mine: Sequence[int]) -> None:
    """Other ranks' stages to the meta device (shapes only), but for modules a stage of this rank uses
    (replicated blocks; a tied parameter keeps this rank's copy, its other users get meta ones)."""
    keep = {id(sub) for s in mine for sub in stages[s].modules()}

    def release(m: nn.Module) -> None:
        if not any(id(c) in keep for c in m.modules()):  # m itself among them
            m.to("meta")
        elif id(m) not in keep:
            for child in m.children():
                release(child)

    for s, stage in enumerate(stages):
        if s not in mine:
            release(stage)


def _ids(module: nn.Module) -> set[int]:
    return {id(t) for t in [*module.parameters(), *module.buffers()]}


def _mirror(into: nn.Module, source: nn.Module, keep: set[int]) -> None:
    """Register in ``into`` what ``source`` holds of the tensors in ``keep`` (ids), at the same paths:
    a child whose tensors are all kept is registered itself (so its hooks fire when it runs); a child
    holding some is mirrored by an empty container, recursively."""
    for name, p in source.named_parameters(recurse=False):
        if id(p) in keep:
            into.register_parameter(name, p)
    temporary = non_persistent_buffers(source)
    for name, b in source.named_buffers(recurse=False):
        if id(b) in keep:
            into.register_buffer(name, b, persistent=name not in temporary)
    for name, child in every_child(source):
        held = _ids(child)
        if held <= keep and held:
            into.add_module(name, child)
        elif held & keep:
            sub = nn.Module()
            into.add_module(name, sub)
            _mirror(sub, child, keep)


class StageRoot(nn.Module):
    """This rank's pipeline stages, the module the data-parallel strategy wraps: the user's own modules
    of these stages registered at their paths in the whole model (``state_dict()`` keyed like the plain
    module; FSDP/ZeRO-3 hooks fire when a stage runs them); the stages themselves are kept outside the
    module tree, so nothing is registered twice."""

    def __init__(self, module: nn.Module, stages: Mapping[int, nn.Module]) -> None:
        super().__init__()
        _mirror(self, module, set().union(*(_ids(stage) for stage in stages.values())))
        self.__dict__["_run"] = dict(stages)
        self.__dict__["_whole"] = module  # not registered: whose attributes a user may ask this for

    @property
    def whole_model(self) -> nn.Module:
        """The model that was wrapped (its other stages' modules are not this rank's)."""
        return cast(nn.Module, self.__dict__["_whole"])

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as exc:
            whole = self.__dict__.get("_whole")
            if whole is None or name.startswith("_") or not hasattr(whole, name):
                raise
            raise AttributeError(
                f"model.module under a pipeline is this rank's stages (StageRoot), which have no {name!r}; "
                "it is on the model you wrapped (model.generate, model.save_pretrained, ... name their fix)"
            ) from exc

    def forward(self, x: torch.Tensor, stage: Any = None, *inputs: torch.Tensor, **kwargs: Any) -> Any:
        """Stage ``stage`` (an index of the whole pipeline) on ``x``; a stage of a model split at module
        names also takes the micro-batch's model ``inputs`` (its copy of the forward recomputes
        positions, masks). Called as the plain model (``model.module(x)``): refused, naming the fix."""
        run: dict[int, nn.Module] = self.__dict__["_run"]
        if kwargs or not isinstance(stage, int) or stage not in run:
            raise StrategyError(
                f"model.module under a pipeline is this rank's pipeline stages {sorted(run)}, which the "
                "pipeline runs one at a time, not the model you wrapped. For inference through every stage "
                "call model(x) (in eval mode or under torch.no_grad(): the output on every rank); to train, "
                "model.train_step((inputs, targets), loss_fn); for the whole model in one process, load "
                "model.state_dict() (on every rank) into a plain module"
            )
        return run[stage](x, *inputs)

    def train(self, mode: bool = True) -> StageRoot:
        super().train(mode)
        for stage in self.__dict__["_run"].values():
            stage.train(mode)
        return self
