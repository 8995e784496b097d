"""Tensor-parallel plans: which submodule becomes which parallel layer.

A plan maps fully qualified module names (``fnmatch`` patterns per dotted part, as torch's
``parallelize_module``: ``"blocks.*.mlp.0"``) to a style, a string or a style object
(:mod:`dtlab.models.tensor._styles`; what each does to its module, under dtlab's and Hugging Face's
names: docs/your_model.md, "The tensor plan"). :func:`resolve_plan` checks everything (every pattern
matches, types, divisibility by tp) before any communication; :func:`apply_plan` then swaps the modules
in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import cast

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models.tensor._comm import SharedInput, check_divisible, scatter_to_sequence
from dtlab.models.tensor._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_features,
)
from dtlab.models.tensor._styles import (
    ColwiseParallel,
    DeclaredPlan,
    HeadsParallel,
    Plan,
    PlanDict,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallel,
    check_style_names,
    style_of,
    transformer_plan,
)

__all__ = [
    "ColwiseParallel",
    "HeadsParallel",
    "Plan",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "VocabParallel",
    "apply_plan",
    "check_style_names",
    "splits_logits",
    "resolve_plan",
    "transformer_plan",
    "DeclaredPlan",
    "PlanDict",
]


def splits_logits(root: nn.Module) -> bool:
    """Whether ``root``'s output is split over tp along its last dim: its last tensor-parallel layer (in
    registration order, the output layer of a language model) is column-parallel without gathering
    (dtlab's transformer); Hugging Face's plans gather the head's output (``colwise_gather_output``)."""
    last: nn.Module | None = None
    for m in root.modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            last = m
    return isinstance(last, ColumnParallelLinear) and not last.gather_output


def _mismatch(style: Style, kind: str, name: str, module: nn.Module) -> StrategyError:
    return StrategyError(
        f"tensor-parallel plan: {type(style).__name__} applies to a {kind}, but module {name!r} is a "
        f"{type(module).__name__}; fix the pattern that matched it"
    )


def _check_split(name: str, what: str, size: int, tp: int, hint: str = "") -> None:
    check_divisible(size, tp, f"tensor-parallel plan: module {name!r}: {what}", hint)


def _check_one(root: nn.Module, name: str, module: nn.Module, style: Style, tp: int) -> None:
    if isinstance(style, ColwiseParallel | RowwiseParallel):
        features = linear_features(module)
        if features is None:
            raise _mismatch(style, "Linear (nn.Linear or Hugging Face's Conv1D)", name, module)
        if isinstance(style, RowwiseParallel):
            split, what = features[0], "in_features"
        elif features[1] % style.sections:
            raise StrategyError(
                f"tensor-parallel plan: module {name!r}: out_features {features[1]} is not "
                f"{style.sections} equal sections"
            )
        else:
            split, what = features[1] // style.sections, f"out_features / {style.sections} sections"
        _check_split(name, what, split, tp)
        head_dim = getattr(root.get_submodule(name.rpartition(".")[0]), "head_dim", None)
        _check_whole_heads(name, split, head_dim, tp)
    elif isinstance(style, VocabParallel):
        if not isinstance(module, nn.Embedding):
            raise _mismatch(style, "Embedding", name, module)
        _check_split(
            name,
            "the vocabulary (num_embeddings)",
            module.num_embeddings,
            tp,
            f"pad the vocabulary to a multiple of {tp} or choose a tp that divides {module.num_embeddings}",
        )
    elif isinstance(style, HeadsParallel):
        _check_heads(root, name, module, style, tp)


def _check_whole_heads(name: str, features: int, head_dim: object, tp: int) -> None:
    """A projection (of ``features`` split features) of an attention module that declares ``head_dim``
    (Hugging Face's do) is split in whole heads: grouped-query attention's key/value projections have
    fewer heads than the queries."""
    if not isinstance(head_dim, int) or head_dim <= 0 or features % head_dim:
        return
    heads = features // head_dim
    if heads % tp:
        raise StrategyError(
            f"tensor-parallel plan: module {name!r} projects {heads} attention heads of {head_dim} "
            f"(its module's head_dim; key/value heads under grouped-query attention), not divisible by "
            f"tp={tp}; choose a tp that divides {heads}"
        )


def _check_heads(root: nn.Module, name: str, module: nn.Module, style: HeadsParallel, tp: int) -> None:
    heads = getattr(module, style.heads, None)
    if not isinstance(heads, int):
        raise StrategyError(
            f"tensor-parallel plan: HeadsParallel needs module {name!r} to hold its head count in "
            f"an int attribute {style.heads!r} (got {heads!r}); set HeadsParallel(heads=...)"
        )
    what = "the number of attention heads" if "head" in style.heads else f"its {style.heads!r}"
    _check_split(name, what, heads, tp)
    for child, part in style.parts():
        projection = getattr(module, child, None)
        if not isinstance(projection, nn.Module) or (features := linear_features(projection)) is None:
            raise StrategyError(
                f"tensor-parallel plan: HeadsParallel needs {name}.{child} to be an nn.Linear or a "
                f"Conv1D (got {type(projection).__name__}); set HeadsParallel(qkv=..., out=...)"
            )
        if isinstance(part, ColwiseParallel) and features[1] % (style.sections * heads):
            raise StrategyError(
                f"tensor-parallel plan: {name}.{child} has {features[1]} output features, not "
                f"{style.sections} sections x {heads} ({style.heads}); set HeadsParallel(sections=...)"
            )
        _check_one(root, f"{name}.{child}", projection, part, tp)  # its split, in whole heads


def _matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted part, as torch's ``parallelize_module``: ``blocks.*`` is ``blocks.0``,
    never ``blocks.0.mlp``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True))


def resolve_plan(module: nn.Module, plan: PlanDict, tp: int) -> list[tuple[str, nn.Module, Style]]:
    """``(name, module, style)`` for every module the plan matches; every check, no communication.
    ``plan``: a mapping (:func:`dtlab.models.tensor._auto.declared_plan` gives the model's own)."""
    if not isinstance(plan, Mapping) or not plan:
        raise StrategyError(
            "TensorParallelModel needs a plan {'fqn-pattern': style} with at least one entry, got "
            f"{plan!r}; e.g. transformer_plan() for dtlab's TransformerLM"
        )
    named = list(module.named_modules())
    found: dict[str, tuple[nn.Module, Style, str]] = {}
    for pattern, value in plan.items():
        style = style_of(value, pattern)
        if style is None:
            continue
        hits = [(n, m) for n, m in named if n and _matches(n, pattern)]
        if not hits:
            sample = [n for n, _ in named if n][:8]
            raise StrategyError(
                f"tensor-parallel plan: pattern {pattern!r} matches no module of {type(module).__name__} "
                f"(its modules include {sample}); a pattern is matched part by part (fnmatch between dots)"
            )
        for n, m in hits:
            if n in found:
                raise StrategyError(
                    f"tensor-parallel plan: module {n!r} is matched by both {found[n][2]!r} and {pattern!r}"
                )
            _check_one(module, n, m, style, tp)
            found[n] = (m, style, pattern)
    names = list(found)
    for n in names:  # a swapped module may not contain another planned module
        inner = [o for o in names if o != n and o.startswith(n + ".")]
        if inner and not isinstance(found[n][1], SequenceParallel):
            raise StrategyError(
                f"tensor-parallel plan: {n!r} is swapped as a whole but the plan also names modules inside "
                f"it: {inner}"
            )
    return [(n, m, s) for n, (m, s, _) in found.items()]


def apply_plan(
    root: nn.Module, resolved: list[tuple[str, nn.Module, Style]], group: CommunicationBackend
) -> list[nn.Parameter]:
    """Swap the planned modules of ``root`` in place for their parallel versions (this rank's shards).
    Returns the replicated parameters whose gradients are partial sums over tp (sequence parallel)."""
    partial: list[nn.Parameter] = []

    def swap(name: str, style: ColwiseParallel | RowwiseParallel | VocabParallel) -> None:
        old, sp = root.get_submodule(name), style.sequence_parallel
        new: nn.Module
        if isinstance(style, ColwiseParallel):
            new = ColumnParallelLinear.from_linear(
                old, group, gather_output=style.gather_output, sequence_parallel=sp, sections=style.sections
            )
        elif isinstance(style, RowwiseParallel):
            row = RowParallelLinear.from_linear(
                old, group, input_is_parallel=style.input_is_parallel, sequence_parallel=sp
            )
            if sp and row.bias is not None:  # added after the reduce-scatter
                partial.append(row.bias)
            new = row
        else:  # resolve_plan checked it is an nn.Embedding
            new = VocabParallelEmbedding.from_embedding(cast(nn.Embedding, old), group, sequence_parallel=sp)
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent), child, new)

    for name, module, style in resolved:
        if isinstance(style, HeadsParallel):
            for child, part in style.parts():
                swap(f"{name}.{child}", part)
            setattr(module, style.heads, getattr(module, style.heads) // group.world_size)
        elif not isinstance(style, SequenceParallel):
            swap(name, style)
        elif style.split_output:
            module.register_forward_hook(lambda _m, _inputs, out: scatter_to_sequence(out, group))
        else:
            partial.extend(p for p in module.parameters(recurse=True) if p.requires_grad)
    shared = SharedInput()  # column-parallel layers reading one tensor all-reduce its gradient once
    for m in root.modules():
        if isinstance(m, ColumnParallelLinear):
            m.shared_input = shared
    return partial
