"""Tensor-parallel plans: the styles, and which submodule becomes which parallel layer.

A plan maps fully qualified module names (``fnmatch`` patterns per dotted part, as torch's
``parallelize_module``: ``"blocks.*.mlp.0"``) to a style, a string or a style object (what each does
to its module, under dtlab's and Hugging Face's names: docs/your_model.md, "The tensor plan"; the
Hugging Face styles dtlab cannot honour exactly are refused, naming the style and the module).
:func:`resolve_plan` checks everything (every pattern matches, types, divisibility by tp) before any
communication; :func:`apply_plan` then swaps the modules in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, cast

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError, check_switches
from dtlab.models.tensor._comm import SharedInput, check_divisible, scatter_to_sequence
from dtlab.models.tensor._fused import check_fused, check_head_split
from dtlab.models.tensor._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_parameters,
)
from dtlab.models.tensor._sources import adapter_hint, linear_features
from dtlab.models.tensor._split_draws import SplitDraws
from dtlab.models.tensor._styles import (
    ColwiseParallel,
    HeadsParallel,
    PlanDict,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallel,
)

__all__ = [
    "ColwiseParallel",
    "DeclaredPlan",
    "HeadsParallel",
    "Plan",
    "PlanDict",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "VocabParallel",
    "apply_plan",
    "check_style_names",
    "logits_head",
    "resolve_plan",
    "transformer_plan",
]


@dataclass(frozen=True)
class DeclaredPlan:
    """The plan the model declares itself: its ``tp_plan(sequence_parallel=...)`` (as Hugging Face
    models declare ``_tp_plan``), resolved when the strategy wraps it."""

    sequence_parallel: bool = False


#: what the strategies take: ``{"fqn-pattern": style}``, or the plan the model declares (``"auto"``:
#: its ``tp_plan()`` method, Hugging Face's ``_tp_plan`` / ``config.base_model_tp_plan``, or a recipe)
Plan = PlanDict | DeclaredPlan | Literal["auto"]

_ALIASES: dict[str, Style | None] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "vocab": VocabParallel(),
    "heads": HeadsParallel(),
    "sequence": SequenceParallel(),
    "replicate": None,  # the module left whole on every rank
    # Hugging Face's style names (transformers' ALL_PARALLEL_STYLES) with the same meaning
    "colwise_gather_output": ColwiseParallel(gather_output=True),
    "colwise_rep": ColwiseParallel(gather_output=True),
    "rowwise_split_input": RowwiseParallel(input_is_parallel=False),
    "rowwise_rep": RowwiseParallel(input_is_parallel=False),
    "embedding_rowwise": VocabParallel(),
    "packed_colwise": ColwiseParallel(sections=2),  # a fused [gate | up] projection, each part split
    # a module left whole whose parameters' gradients are partial over tp (Qwen3's per-head q_norm sees
    # this rank's heads): summed over tp, as sequence parallelism's norms
    "replicated_with_grad_allreduce": SequenceParallel(),
}

#: Hugging Face styles dtlab cannot honour exactly, and why (refused, naming the module)
_REFUSED = {
    "embedding_colwise": "it splits the embedding's hidden dim, dtlab splits the vocabulary",
    "packed_rowwise": "a packed projection's input is two fused parts",
    "sequence_parallel": "Hugging Face's sequence parallelism is not dtlab's (use dtlab's "
    "SequenceParallel on a plan that is sequence parallel throughout)",
    "all_reduce": "an all-reduce of a module's output",
    "gather": "an all-gather of a module's output",
    "local_params": "parameters used as local tensors",
    "isolated": "an isolated module per rank",
    "mla_kv_a_proj": "multi-head latent attention's split of the kv projection",
    **dict.fromkeys(["moe_tp_experts", "moe_identity_expert", "grouped_gemm"], "mixture-of-experts layers"),
    **dict.fromkeys(["ep_dispatch_experts", "ep_router"], "expert parallelism"),
    **dict.fromkeys(
        ["local", "local_colwise", "local_rowwise", "local_packed_rowwise", "local_packed_colwise"],
        "local (DTensor-free) layers",
    ),
}


def transformer_plan(sequence_parallel: bool = False) -> DeclaredPlan:
    """The plan the model declares (``module.tp_plan(sequence_parallel=...)``: dtlab's ``TransformerLM``
    declares Megatron's layout, its logits split over the vocabulary), optionally sequence parallel."""
    check_switches("transformer_plan", sequence_parallel=sequence_parallel)
    return DeclaredPlan(sequence_parallel)


def style_of(value: Style | str, pattern: str) -> Style | None:
    """The style plan entry ``pattern: value`` gives (``None``: ``"replicate"``, the module left whole)."""
    if isinstance(value, Style):
        return value
    if not isinstance(value, str):
        raise StrategyError(
            f"tensor-parallel plan entry {pattern!r}: a style is a string {sorted(_ALIASES)} or a style "
            f"object, got {value!r}"
        )
    if value in _REFUSED:
        raise StrategyError(
            f"tensor-parallel plan entry {pattern!r}: style {value!r} cannot be honoured exactly "
            f"({_REFUSED[value]}); give a plan without it (plan={{'fqn-pattern': style}}, styles "
            f"{sorted(_ALIASES)} or style objects) or leave the module out of the plan"
        )
    if value not in _ALIASES:
        raise StrategyError(
            f"tensor-parallel plan entry {pattern!r}: unknown style {value!r}; use one of "
            f"{sorted(_ALIASES)} or a style object (ColwiseParallel(...), ...)"
        )
    return _ALIASES[value]


def check_style_names(plan: PlanDict) -> None:
    """Every style of ``plan`` is one dtlab honours (before any model is built)."""
    for pattern, value in plan.items():
        style_of(value, pattern)


def logits_head(root: nn.Module) -> ColumnParallelLinear | None:
    """``root``'s output layer where its output is split over tp along its last dim: its last
    tensor-parallel layer (in registration order, the output layer of a language model) when it is
    column-parallel without gathering (dtlab's transformer); Hugging Face's plans gather the head's
    output (``colwise_gather_output``)."""
    layers = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    split = [m for m in root.modules() if isinstance(m, layers)]
    last = split[-1] if split else None
    return last if isinstance(last, ColumnParallelLinear) and not last.gather_output else None


def _mismatch(style: Style, kind: str, name: str, module: nn.Module) -> StrategyError:
    return StrategyError(
        f"tensor-parallel plan: {type(style).__name__} applies to a {kind}, but module {name!r} is a "
        f"{type(module).__name__}; fix the pattern that matched it{adapter_hint(name, module)}"
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
        _check_split(name, what, split, tp, _vocab_hint(root, split, tp) if what != "in_features" else "")
        head_dim = getattr(root.get_submodule(name.rpartition(".")[0]), "head_dim", None)
        _check_whole_heads(name, split, head_dim, tp)
    elif isinstance(style, VocabParallel):
        if not isinstance(module, nn.Embedding):
            raise _mismatch(style, "Embedding", name, module)
        size = module.num_embeddings
        _check_split(name, "the vocabulary (num_embeddings)", size, tp, _vocab_hint(root, size, tp, True))
    elif isinstance(style, HeadsParallel):
        _check_heads(root, name, module, style, tp)
    if isinstance(style, ColwiseParallel | RowwiseParallel | VocabParallel):  # swapped: its parameters split
        check_parameters(module, f"tensor-parallel plan: module {name!r}")


def _vocab_hint(root: nn.Module, size: int, tp: int, vocabulary: bool = False) -> str:
    """How to fix a vocabulary of ``size`` that tp does not divide (``""``: ``size`` is no vocabulary);
    a Hugging Face model (``config.vocab_size``) pads its own."""
    hf = getattr(getattr(root, "config", None), "vocab_size", None) == size
    if not (hf or vocabulary):
        return ""
    own = f" (hf_model.resize_token_embeddings(pad_to_multiple_of={tp}) before wrapping)" if hf else ""
    return f"pad the vocabulary to a multiple of {tp}{own} or choose a tp that divides {size}"


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
    if not isinstance(plan, Mapping) or not plan or not all(isinstance(k, str) for k in plan):
        raise StrategyError(
            "TensorParallelModel needs a plan {'fqn-pattern' (a str): style} with at least one entry, got "
            f"{plan!r}; e.g. transformer_plan() for dtlab's TransformerLM"
        )
    named = list(module.named_modules())
    found: dict[str, tuple[nn.Module, Style, str]] = {}
    styles = {pattern: style_of(value, pattern) for pattern, value in plan.items()}
    summed = {  # left whole, gradient summed over tp: one table for every head (check_head_split)
        id(m)
        for p, st in styles.items()
        if isinstance(st, SequenceParallel)
        for n, m in named
        if _matches(n, p)
    }
    for pattern, style in styles.items():
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
            if isinstance(style, ColwiseParallel) and not style.gather_output:
                check_fused(module, n, style.sections)
                attention = module.get_submodule(n.rpartition(".")[0])
                head_dim, features, heads = getattr(attention, "head_dim", None), linear_features(m), None
                if isinstance(head_dim, int) and head_dim > 0 and features:  # Hugging Face's declare it
                    heads = features[1] // head_dim
                check_head_split(module, n, attention, heads, summed)
            elif isinstance(style, HeadsParallel):
                check_head_split(module, n, m, getattr(m, style.heads), summed)
            found[n] = (m, style, pattern)
    for n in found:  # a swapped module may not contain another planned module
        inner = [o for o in found if o.startswith(n + ".")]
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
        root.set_submodule(name, new)

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
    SplitDraws().install(root)  # dropout between a column- and a row-parallel layer: this rank's masks
    return partial
