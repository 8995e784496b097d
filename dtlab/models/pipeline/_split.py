"""Splitting a module with blocks into pipeline stages, deterministically on every rank.

The blocks are an ``nn.Sequential``'s children or the ``(name, block)`` pairs of a ``pipeline_blocks()``
method, each one tensor in and one tensor out, together covering every parameter and buffer
(docs/strategies.md, "Stages"); a parameter used by blocks of several stages is tied across them
(:mod:`dtlab.models.pipeline._ties`). A module without blocks is split at module names
(:mod:`dtlab.models.pipeline._trace`). The tensors between stages come from a forward on the meta
device with the micro-batch's shape, alike on every rank: nothing is negotiated at run time.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from dtlab.errors import ArgumentTypeError, StrategyError
from dtlab.untrusted import summary

__all__ = [
    "Shapes",
    "Stage",
    "TensorSpec",
    "TupleSpec",
    "balanced_split",
    "check_split_count",
    "every_child",
    "has_blocks",
    "module_blocks",
    "split_blocks",
    "stage_shapes",
    "stage_specs",
]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TupleSpec(TensorSpec):
    """The last stage's output when it is a tuple of tensors (the logits and an auxiliary loss, as a
    mixture-of-experts model returns them): ``items``, each tensor's spec (``shape`` and ``dtype``: the
    first's; ``nbytes``: all of them); ``marked``, which items came out as a tensor subclass (the logits
    split over tp)."""

    items: tuple[TensorSpec, ...] = ()
    marked: tuple[bool, ...] = ()

    @classmethod
    def of_items(cls, items: Sequence[torch.Tensor]) -> TupleSpec:
        specs = tuple(TensorSpec.of(t) for t in items)
        marked = tuple(type(t) is not torch.Tensor for t in items)
        return cls(specs[0].shape, specs[0].dtype, specs, marked)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


class Stage(nn.Module):
    """Consecutive blocks run one after another (the blocks are the user's own modules)."""

    def __init__(self, index: int, named_blocks: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.index = index
        self.names = [n for n, _ in named_blocks]
        self.blocks = nn.ModuleList([b for _, b in named_blocks])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def __repr__(self) -> str:
        return f"Stage({self.index}: {self.names[0]} .. {self.names[-1]})"


def has_blocks(module: nn.Module) -> bool:
    """Whether ``module`` is split at blocks: an ``nn.Sequential`` or a module with ``pipeline_blocks()``."""
    return callable(getattr(module, "pipeline_blocks", None)) or isinstance(module, nn.Sequential)


def every_child(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s children under every name it holds them by (``named_children()`` lists a child held
    twice once)."""
    return [(n, c) for n, c in module.named_modules(remove_duplicate=False) if n and "." not in n]


def module_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ordered ``(name, block)`` pairs of ``module``, checked to cover every parameter once."""
    custom = getattr(module, "pipeline_blocks", None)
    if callable(custom):
        pairs = list(custom())
        odd = next((p for p in pairs if not (isinstance(p, tuple | list) and len(p) == 2)), None)
        if odd is not None:
            raise StrategyError(
                f"{type(module).__name__}.pipeline_blocks() must return (name, block) pairs, got a "
                f"{type(odd).__name__} among them; return e.g. [(f'layers.{{i}}', layer) for i, layer in "
                "enumerate(self.layers)]"
            )
        blocks = [(str(n), b) for n, b in pairs]
    elif isinstance(module, nn.Sequential):
        blocks = every_child(module)  # as its forward runs them, a module there twice included
    else:
        raise StrategyError(
            f"PipelineParallelModel splits an nn.Sequential or a module with a pipeline_blocks() method "
            f"returning its ordered (name, block) pairs (each block: one tensor in, one tensor out); "
            f"{type(module).__name__} has neither. Wrap its layers in nn.Sequential or add pipeline_blocks()"
        )
    if not blocks:
        raise StrategyError(
            f"{type(module).__name__} has no blocks to split into pipeline stages (an empty nn.Sequential, "
            "or pipeline_blocks() returned nothing); give it its layers as blocks"
        )
    names = [n for n, _ in blocks]
    twice = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if twice:
        raise StrategyError(
            f"pipeline block names must be unique, got {names} ({twice} more than once); give each "
            "(name, block) pair of pipeline_blocks() its own name, e.g. the block's attribute path"
        )
    owner: dict[int, str] = {}
    for name, block in blocks:
        if not isinstance(block, nn.Module):
            raise StrategyError(
                f"pipeline block {name!r} is a {type(block).__name__}, not an nn.Module; wrap it in a "
                "module whose forward calls it, or fold it into the forward of the block before it"
            )
        for t in block.parameters():
            owner.setdefault(id(t), name)  # a tied parameter: each stage using it keeps a copy in sync
        for b in block.buffers():
            if owner.setdefault(id(b), name) != name:
                raise StrategyError(
                    f"a buffer is used by pipeline blocks {owner[id(b)]!r} and {name!r}, which may run on "
                    "different ranks; give each block its own buffer or put both users in one block"
                )
    missing = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if id(t) not in owner]
    if missing:
        raise StrategyError(
            f"{len(missing)} parameters or buffers of {type(module).__name__} belong to no pipeline block "
            f"and would be dropped: {missing[:6]}{' ...' if len(missing) > 6 else ''}; make "
            "pipeline_blocks() cover the whole module"
        )
    return blocks


def balanced_split(sizes: Sequence[int], stages: int) -> list[int]:
    """Start index of each of ``stages`` contiguous, non-empty groups of ``sizes`` minimising the
    largest group's sum (ties: the latest cut, so a parameterless block such as an activation stays
    with the layer before it). Deterministic, so every rank computes the same."""
    n, inf = len(sizes), float("inf")
    prefix = list(itertools.accumulate(sizes, initial=0))
    # rows[k][i]: the smallest largest sum splitting the first i blocks into k + 1 groups, and minus the
    # last group's start (so min breaks a tie by the latest cut); row by row, not recursive (any number
    # of stages), over the i a split of all n blocks can reach
    rows: list[list[tuple[float, int]]] = [[(s, 0) for s in prefix]] if stages else []
    for k in range(1, stages):
        prev, row = [cost for cost, _ in rows[-1]], [(inf, 0)] * (n + 1)
        for i in range(k + 1, n - (stages - k - 1) + 1):
            row[i] = min((max(prev[j], prefix[i] - prefix[j]), -j) for j in range(k, i))
        rows.append(row)
    starts, i = [], n
    for row in reversed(rows):
        i = -row[i][1]
        starts.append(i)
    return starts[::-1]


def check_split_count(split_points: Sequence[str], stages: int, what: str) -> list[str]:
    """``split_points`` as a list, refused unless there is one per stage after the first (``what``
    they are, for the message)."""
    if isinstance(split_points, str):  # its characters would be taken as block names
        raise ArgumentTypeError(
            f"split_points must be a list of block names, e.g. [{split_points!r}], got a str"
        )
    points = list(split_points)
    if len(points) != stages - 1:
        raise StrategyError(
            f"{stages} pipeline stages need {stages - 1} split points ({what} where stages 1..{stages - 1} "
            f"begin), got {len(points)}: {points}"
        )
    return points


def split_blocks(
    blocks: list[tuple[str, nn.Module]], stages: int, split_points: Sequence[str] | None
) -> list[Stage]:
    """``stages`` stages of consecutive blocks, cut where ``split_points`` name a block (or balanced)."""
    names = [n for n, _ in blocks]
    if len(blocks) < stages:
        raise StrategyError(
            f"the module has {len(blocks)} pipeline blocks ({names}) but the pipeline needs {stages} stages "
            "(pp size x stages_per_rank); use fewer stages or a module with more blocks"
        )
    if split_points is None:
        starts = balanced_split([sum(p.numel() for p in b.parameters()) for _, b in blocks], stages)
    else:
        points = check_split_count(split_points, stages, "the block names")
        unknown = [p for p in points if p not in names]
        if unknown:
            raise StrategyError(f"split points {unknown} name no pipeline block; the blocks are {names}")
        starts = [0] + [names.index(p) for p in points]
        if names[0] in points or any(b <= a for a, b in itertools.pairwise(starts)):
            raise StrategyError(
                f"split points must name blocks after the first, in order, each once: got {points} for "
                f"blocks {names}"
            )
    return [Stage(i, blocks[a:b]) for i, (a, b) in enumerate(itertools.pairwise([*starts, len(blocks)]))]


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def stage_shapes(stage: nn.Module, remove_duplicate: bool = True) -> Shapes:
    """``{name: (shape, dtype)}`` of a stage's parameters and buffers (recorded while they are whole:
    ZeRO-3/FSDP hold only shards at rest, other ranks' stages are on the meta device); a tied tensor
    under each of its names unless ``remove_duplicate``."""
    named = [
        *stage.named_parameters(remove_duplicate=remove_duplicate),
        *stage.named_buffers(remove_duplicate=remove_duplicate),
    ]
    return {n: (tuple(t.shape), t.dtype) for n, t in named}


def stage_specs(stages: Sequence[Stage], shapes: Sequence[Shapes], sample: TensorSpec) -> list[TensorSpec]:
    """Output spec of every stage for an input like ``sample``, by a forward on the meta device with
    each stage's recorded ``shapes``."""
    x = torch.empty(sample.shape, dtype=sample.dtype, device="meta")
    out: list[TensorSpec] = []
    with torch.no_grad():
        for stage, held in zip(stages, shapes, strict=True):
            state = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in held.items()}
            try:
                y = functional_call(stage, state, (x,))
            except Exception as exc:
                raise StrategyError(
                    f"the shape of pipeline stage {stage.index}'s output ({stage.names[0]} .. "
                    f"{stage.names[-1]}) could not be computed by a forward on the meta device with input "
                    f"{tuple(x.shape)} {x.dtype}: {type(exc).__name__}: {exc}. Stages must be shape-static "
                    "(no data-dependent control flow, .item() or host copies); your forward hooks run in "
                    "this forward too: one reading values (activation statistics) returns on meta tensors "
                    "first, if out.is_meta: return"
                ) from exc
            last = stage.index == len(stages) - 1
            if last and isinstance(y, tuple) and y and all(isinstance(t, torch.Tensor) for t in y):
                out.append(TupleSpec.of_items(y))  # to loss_fn (the logits and an auxiliary loss)
                continue
            if not isinstance(y, torch.Tensor):
                raise StrategyError(
                    f"pipeline stage {stage.index} ({stage.names[-1]}) returns "
                    f"{summary(y) if last else f'a {type(y).__name__}'}; every block must return one tensor, "
                    "the last may return a tuple of tensors (they go to loss_fn: the logits and an auxiliary "
                    "loss): wrap a block returning several values in a module returning the one the next "
                    "block takes (e.g. an LSTM's output, lstm(x)[0])"
                )
            out.append(TensorSpec.of(y))
            x = y
    return out
