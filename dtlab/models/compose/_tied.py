"""Tied (shared) parameters under the model-parallel composition: never silently untied.

A parameter reachable under two names (GPT-2's ``lm_head.weight`` *is* ``transformer.wte.weight``) is
one weight. The tensor plan swaps modules for parallel versions holding copies of shards, which would
give each user its own copy; a pipeline puts blocks on different ranks. So, before any communication:

- tensor parallelism keeps the tie when the plan splits the copies the same way: an ``nn.Embedding``
  made ``"vocab"`` and an ``nn.Linear`` made ``"colwise"`` (one section) share the weight's dim 0 (the
  vocabulary) identically, so after the swap the linear layer is given the embedding's shard
  (:func:`retie`); a tie the plan does not touch stays as it is; any other tie the plan touches is
  refused, naming the tied parameters;
- a pipeline keeps a parameter used by stages on several ranks tied as Megatron-LM does
  (:mod:`dtlab.models.pipeline._ties`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dtlab.errors import StrategyError
from dtlab.models.tensor._plan import (
    ColwiseParallel,
    HeadsParallel,
    SequenceParallel,
    Style,
    VocabParallel,
)

__all__ = ["Retie", "check_tied", "retie", "tied_groups", "touched_layers"]

#: ``(linear module name, embedding module name)``: the linear layer's weight becomes the embedding's
Retie = tuple[str, str]

_FIX = (
    "keep the tie by making the embedding 'vocab' and the output layer 'colwise' in the plan (both split "
    "the vocabulary dimension the same way), leave both out of the plan, or untie them in the model "
    "before wrapping (e.g. Hugging Face: config.tie_word_embeddings=False; this changes the model)"
)


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The names of every parameter reachable under more than one name, one list per parameter."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def touched_layers(resolved: Sequence[tuple[str, nn.Module, Style]]) -> dict[str, Style]:
    """Module names whose parameters the plan replaces (or marks as partial sums), with the style."""
    out: dict[str, Style] = {}
    for name, _module, style in resolved:
        if isinstance(style, HeadsParallel):
            for child in (*style.qkv, style.out):
                out[f"{name}.{child}"] = style
        elif isinstance(style, SequenceParallel):
            if not style.split_output:  # split_output only hooks the output
                out[name] = style
        else:
            out[name] = style
    return out


def _owner(param: str, touched: dict[str, Style]) -> tuple[str, Style] | None:
    for mod, style in touched.items():
        if param.startswith(mod + "."):
            return mod, style
    return None


def _tensor_ties(
    who: str, groups: list[list[str]], resolved: Sequence[tuple[str, nn.Module, Style]]
) -> list[Retie]:
    touched = touched_layers(resolved)
    out: list[Retie] = []
    for names in groups:
        hits = {n: _owner(n, touched) for n in names}
        if all(h is None for h in hits.values()):
            continue  # the plan leaves every user whole: still one parameter
        vocab = [(n, h[0]) for n, h in hits.items() if h and isinstance(h[1], VocabParallel)]
        col = [
            (n, h[0])
            for n, h in hits.items()
            if h and isinstance(h[1], ColwiseParallel) and h[1].sections == 1
        ]
        if (
            len(names) == 2
            and len(vocab) == 1
            and len(col) == 1
            and vocab[0][0] == vocab[0][1] + ".weight"
            and col[0][0] == col[0][1] + ".weight"
        ):
            out.append((col[0][1], vocab[0][1]))
            continue
        how = ", ".join(
            f"{n}: {type(h[1]).__name__} on {h[0]!r}" if h else f"{n}: not in the plan"
            for n, h in hits.items()
        )
        raise StrategyError(
            f"{who}: {' and '.join(repr(n) for n in names)} are one tied parameter, and the tensor plan "
            f"would split its users differently ({how}), silently untying them; {_FIX}"
        )
    return out


def check_tied(
    who: str,
    module: nn.Module,
    resolved: Sequence[tuple[str, nn.Module, Style]] | None,
) -> list[Retie]:
    """Every tie check, before any communication; returns the ties :func:`retie` restores after the
    tensor plan's swap."""
    groups = tied_groups(module)
    if not groups:
        return []
    return _tensor_ties(who, groups, resolved) if resolved else []


def retie(root: nn.Module, ties: Sequence[Retie]) -> None:
    """After the swap: each column-parallel output layer uses its vocabulary-parallel embedding's
    weight (the same rows of the same tensor), so the two stay one parameter."""
    for linear, embedding in ties:
        emb_weight = getattr(root.get_submodule(embedding), "weight", None)
        lin = root.get_submodule(linear)
        lin_weight = getattr(lin, "weight", None)
        if not (isinstance(emb_weight, nn.Parameter) and isinstance(lin_weight, nn.Parameter)) or (
            lin_weight.shape != emb_weight.shape
        ):
            raise StrategyError(
                f"tied weight: {linear}.weight and {embedding}.weight differ after the tensor-parallel "
                f"swap (shapes {getattr(lin_weight, 'shape', None)} and "
                f"{getattr(emb_weight, 'shape', None)}); {_FIX}"
            )
        lin.weight = emb_weight
