"""The styles of a tensor plan (what each string or style object does to a module: docs/your_model.md,
"The tensor plan"), Hugging Face's style names, the ones refused, and the plan types."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dtlab.errors import StrategyError

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
    "check_style_names",
    "style_of",
    "transformer_plan",
]


@dataclass(frozen=True)
class ColwiseParallel:
    """Output features split over tp (``sections``: fused equal parts, each split)."""

    gather_output: bool = False
    sequence_parallel: bool = False
    sections: int = 1


@dataclass(frozen=True)
class RowwiseParallel:
    """Input features split over tp; the output summed (or reduce-scattered along the sequence)."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False


@dataclass(frozen=True)
class VocabParallel:
    """Embedding rows (the vocabulary) split over tp."""

    sequence_parallel: bool = False


@dataclass(frozen=True)
class HeadsParallel:
    """An attention module with a fused projection laid out ``(sections, heads, head_dim)``.

    ``qkv``: the name(s) of its input projection(s) (one fused ``nn.Linear`` with ``sections=3``, or
    three with ``sections=1``); ``out``: its output projection; ``heads``: the attribute holding the
    head count, set to ``heads // tp`` (the forward must read it, or infer heads with ``-1``).
    """

    qkv: tuple[str, ...] = ("qkv",)
    out: str = "proj"
    heads: str = "n_heads"
    sections: int = 3
    sequence_parallel: bool = False

    def parts(self) -> list[tuple[str, ColwiseParallel | RowwiseParallel]]:
        """Its projections and the style each is split by: the input ones per head, the output by rows."""
        sp = self.sequence_parallel
        qkv = ColwiseParallel(sequence_parallel=sp, sections=self.sections)
        return [*((name, qkv) for name in self.qkv), (self.out, RowwiseParallel(sequence_parallel=sp))]


@dataclass(frozen=True)
class SequenceParallel:
    """A module of the sequence-parallel region (norms, dropout, position embeddings)."""

    split_output: bool = False


Style = ColwiseParallel | RowwiseParallel | VocabParallel | HeadsParallel | SequenceParallel
PlanDict = Mapping[str, "Style | str"]


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
}

#: Hugging Face styles dtlab cannot honour exactly, and why (refused, naming the module)
_REFUSED = {
    "embedding_colwise": "it splits the embedding's hidden dim, dtlab splits the vocabulary",
    "packed_rowwise": "a packed projection's input is two fused parts",
    "sequence_parallel": "Hugging Face's sequence parallelism is not dtlab's (use dtlab's "
    "SequenceParallel on a plan that is sequence parallel throughout)",
    "replicated_with_grad_allreduce": "its gradient all-reduce over tp",
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
    """The plan the model declares (``module.tp_plan(sequence_parallel=...)``); for dtlab's built-in
    ``TransformerLM``: attention heads and MLP split, the token embedding vocabulary-parallel, the head
    column-parallel (vocabulary-split logits for ``vocab_parallel_cross_entropy``, never gathered),
    optionally sequence parallel."""
    return DeclaredPlan(bool(sequence_parallel))


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
