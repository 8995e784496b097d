"""Splitting any model at module names: every stage runs the model's own forward (docs/your_model.md,
"How it splits").

``split_points=["model.layers.2"]`` names the modules where stages 1.. begin. The *glue* is the modules
on the paths from the root to the split points (their forward builds positions, masks and rotary
tables and calls the blocks); the *blocks* are the glue's other children. A block with parameters
belongs to the stage its place in the module tree gives it; one without is *replicated* (it runs
wherever the glue calls it). Stage ``k`` is a shallow copy of the glue whose children are its own and
the replicated blocks (the user's modules, so their hooks fire), a :class:`_Stub` for each block of an
earlier stage, an :class:`_Exit` for each block of a later stage and an :class:`_Entry` at its split
point. The trace (:mod:`dtlab.models.pipeline._trace_check`) checks the split before the first step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from dtlab.core.torch_private import non_persistent_buffers
from dtlab.errors import StrategyError
from dtlab.models.pipeline._split import TensorSpec, check_split_count

__all__ = [
    "Slot",
    "StageEnd",
    "TracedStage",
    "TracedStructure",
    "first_tensor",
    "traced_stages",
    "traced_structure",
]

#: where a block's hidden state is among its arguments: a position or a keyword
Slot = int | str


def first_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Slot, torch.Tensor] | None:
    """The slot and value of the first tensor among a call's positional, then keyword, arguments."""
    named: list[tuple[Slot, Any]] = [*enumerate(args), *kwargs.items()]
    return next(((slot, a) for slot, a in named if isinstance(a, torch.Tensor)), None)


class StageEnd(BaseException):
    """Raised by an :class:`_Exit`: the stage ends here with ``payload``."""

    def __init__(self, name: str, payload: Any) -> None:
        super().__init__(name)
        self.name, self.payload = name, payload


@dataclass
class _Run:
    """What the blocks of one stage's copy read while it runs (set by :meth:`TracedStage.forward`)."""

    outputs: dict[str, Any] = field(default_factory=dict)  #: block -> output structure (TensorSpec leaves)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    received: torch.Tensor | None = None
    slot: Slot = 0


class _Proxy(nn.Module):
    """A stand-in for a block in a stage's copy of the glue; attributes the glue reads (such as a
    layer's ``attention_type``) come from the block itself."""

    def __init__(self, name: str, block: nn.Module, run: _Run) -> None:
        self.__dict__["_block"] = block  # not registered: the block is the user's, held by its stage
        self.__dict__["_run"] = run
        super().__init__()
        self.block_name = name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)


class _Stub(_Proxy):
    """A block of an earlier stage: its traced output as zeros (its first input when shaped alike)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run: _Run = self.__dict__["_run"]
        out = run.outputs[self.block_name]
        first = first_tensor(args, kwargs)
        if first is not None and TensorSpec.of(first[1]) == out:
            return first[1]
        return tree_map_only(
            TensorSpec, lambda s: torch.zeros(s.shape, dtype=s.dtype, device=run.device), out
        )


class _Exit(_Proxy):
    """A block of a later stage: calling it ends this stage with its first tensor argument."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = first_tensor(args, kwargs)
        raise StageEnd(self.block_name, None if first is None else first[1])


class _Entry(_Proxy):
    """This stage's first block: called with the hidden state received from the previous stage."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run: _Run = self.__dict__["_run"]
        given, named = list(args), dict(kwargs)
        if run.received is not None:
            if isinstance(run.slot, int):
                given[run.slot] = run.received
            else:
                named[run.slot] = run.received
            run.received = None  # only the first call takes it
        return self.__dict__["_block"](*given, **named)


@dataclass(frozen=True)
class TracedStructure:
    """The split of a whole model at module names (the same on every rank)."""

    points: list[str]  #: split points, in order
    stage_of: dict[str, int]  #: block -> the stage owning it (blocks with parameters, in module order)
    replicated: list[str]  #: blocks without parameters, run wherever the glue calls them
    glue: set[str]  #: the modules on the paths to the split points, and containers among their children


class TracedStage(nn.Module):
    """Stage ``index`` of a model split at module names: ``forward(x, inputs)`` runs the model's
    forward on ``inputs`` with this stage's blocks, starting from ``x`` (the previous stage's hidden
    state; for stage 0, ``inputs`` itself) and returning the next stage's hidden state (the model's
    output on the last stage). ``blocks`` holds the user's modules it runs (its own and the replicated
    ones); the copy of the glue is not registered."""

    def __init__(self, index: int, module: nn.Module, structure: TracedStructure, last: bool) -> None:
        super().__init__()
        self.index, self.last = index, last
        self.names = [b for b, stage in structure.stage_of.items() if stage == index]
        self.replicated = list(structure.replicated)
        self.entry = structure.points[index - 1] if index > 0 else None
        self.exit = None if last else structure.points[index]
        self.blocks = nn.ModuleList([module.get_submodule(b) for b in [*self.names, *self.replicated]])
        self.__dict__["_run"] = _Run()
        self.__dict__["_glue"] = _copy_glue(module, structure, index, self.__dict__["_run"])

    def prepare(self, outputs: dict[str, Any], slots: dict[str, Slot]) -> None:
        """Before a call: the traced output structures of the blocks and where the hidden state is among
        each split point's arguments (from the trace for this input shape)."""
        run: _Run = self.__dict__["_run"]
        run.outputs, run.slot = outputs, slots.get(self.entry or "", 0)

    def stubs(self) -> list[nn.Module]:
        """The stand-ins in this stage's copy of the glue for blocks of earlier stages."""
        return [m for g in self.__dict__["_glue"].values() for m in g.children() if isinstance(m, _Stub)]

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> Any:
        run: _Run = self.__dict__["_run"]
        run.received = x if self.index > 0 else None
        run.device = inputs.device
        try:
            out = self.__dict__["_glue"][""](inputs)  # the model's own forward
        except StageEnd as end:
            if end.name != self.exit or not isinstance(end.payload, torch.Tensor):
                raise StrategyError(
                    f"pipeline stage {self.index} ended at {end.name!r} with "
                    f"{type(end.payload).__name__}, expected split point {self.exit!r} with a tensor: the "
                    f"forward calls {end.name!r}, a block of a later stage, before {self.exit!r}; split at "
                    "the module of each stage the forward calls first"
                ) from None
            return end.payload
        finally:
            run.received = None
        if not self.last:
            raise StrategyError(
                f"pipeline stage {self.index}: the model's forward returned without calling split point "
                f"{self.exit!r} on this input; split at modules the forward calls on every input"
            )
        return out

    def train(self, mode: bool = True) -> TracedStage:
        super().train(mode)
        for glue in self.__dict__["_glue"].values():
            glue.training = mode
        return self

    def __repr__(self) -> str:
        return f"TracedStage({self.index}: {self.names[0] if self.names else '-'} .. {self.exit or 'end'})"


def _children(module: nn.Module, path: str) -> Iterator[tuple[str, str, nn.Module]]:
    for name, child in module.get_submodule(path).named_children():
        yield name, f"{path}.{name}" if path else name, child


def traced_structure(module: nn.Module, split_points: Sequence[str], stages: int) -> TracedStructure:
    """Blocks and their stages for ``split_points`` (checked: existing, in order, not nested)."""
    kind = type(module).__name__
    points = check_split_count(split_points, stages, f"module names of {kind}")
    names = {n for n, _ in module.named_modules()}
    unknown = [p for p in points if not p or p not in names]
    if unknown:
        near = sorted(n for n in names if n.count(".") <= 2)[:12]
        raise StrategyError(f"split points {unknown} name no module of {kind}; its modules include {near}")
    glue = {"", *(".".join(p.split(".")[:i]) for p in points for i in range(1, p.count(".") + 1))}
    nested = sorted(p for p in points if p in glue)
    if nested or len(set(points)) != len(points):
        raise StrategyError(
            f"split points must be distinct modules, none inside another: got {points} ({nested} contain "
            "other split points)"
        )
    direct = [
        n for g in sorted(glue) for n, _ in module.get_submodule(g).named_parameters(prefix=g, recurse=False)
    ]
    if direct:
        raise StrategyError(
            f"parameters {direct} belong to {kind}'s glue (a module on the path to a split point), which "
            "every stage runs; split at other modules, or give the model a pipeline_blocks() method"
        )
    held = [  # its forward reads them on every stage, but no stage holds them: saved, moved, built by none
        f"{g}.{n}" if g else n
        for g in sorted(glue)
        for n, b in module.get_submodule(g).named_buffers(recurse=False)
        if b.is_meta or n not in non_persistent_buffers(module.get_submodule(g))
    ]
    if held:
        raise StrategyError(
            f"buffers {held} belong to {kind}'s glue (a module on the path to a split point), which no "
            "stage holds (a checkpoint, the state and a meta build would leave them out); split at other "
            "modules, or give the model a pipeline_blocks() method"
        )
    blocks: list[str] = []

    def walk(path: str) -> None:
        for _, child_path, child in _children(module, path):
            if child_path in glue:
                walk(child_path)
            elif isinstance(child, nn.ModuleList | nn.ModuleDict):  # containers never run: their items
                glue.add(child_path)
                walk(child_path)
            else:
                blocks.append(child_path)

    walk("")
    containers = [p for p in points if p not in blocks]  # an nn.ModuleList / nn.ModuleDict never runs
    if containers:
        items = [b for b in blocks if b.startswith(containers[0] + ".")][:3]
        raise StrategyError(
            f"split points {containers} are containers of {kind} (nn.ModuleList or nn.ModuleDict), which "
            f"the forward never calls itself; split at one of their items, e.g. {items}"
        )
    with_params = {b for b in blocks if any(True for _ in module.get_submodule(b).parameters())}
    empty = [p for p in points if p not in with_params]
    if empty:
        raise StrategyError(
            f"split points {empty} have no parameters (such modules are replicated on every stage); "
            "split at a module with parameters, e.g. a decoder layer"
        )
    starts = [blocks.index(p) for p in points]
    if starts != sorted(starts):
        raise StrategyError(
            f"split points {points} are not in the order of {kind}'s modules; give them in that order"
        )
    stage_of = {b: sum(s <= i for s in starts) for i, b in enumerate(blocks) if b in with_params}
    return TracedStructure(points, stage_of, [b for b in blocks if b not in with_params], glue)


def _copy_glue(module: nn.Module, st: TracedStructure, k: int, run: _Run) -> dict[str, nn.Module]:
    """Shallow copies of the glue modules for stage ``k``, deepest first, each with its own children."""
    glue = sorted(st.glue, key=lambda p: -p.count(".") if p else 1)
    copies: dict[str, nn.Module] = {}
    entry = st.points[k - 1] if k > 0 else None
    for path in glue:
        clone = copy.copy(module.get_submodule(path))
        children: dict[str, nn.Module | None] = {}
        for name, child_path, child in _children(module, path):
            owner = st.stage_of.get(child_path)
            if child_path in copies:
                children[name] = copies[child_path]
            elif child_path == entry:
                children[name] = _Entry(child_path, child, run)
            elif owner is None or owner == k:
                children[name] = child
            else:
                children[name] = (_Stub if owner < k else _Exit)(child_path, child, run)
        vars(clone)["_modules"] = children  # nn.Module keeps its children in this dict; the copy gets its own
        copies[path] = clone
    return copies


def traced_stages(module: nn.Module, split_points: Sequence[str], stages: int) -> list[TracedStage]:
    """``stages`` stages of ``module`` split at the module names ``split_points``."""
    st = traced_structure(module, split_points, stages)
    return [TracedStage(k, module, st, k == stages - 1) for k in range(stages)]
