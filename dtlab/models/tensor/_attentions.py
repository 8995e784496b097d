"""Attention under tensor parallelism, where each tp rank holds its own heads (a ``colwise`` q projection
holds whole heads, in order).

:func:`whole_attentions`: the attention weights a Hugging Face model returns (``output_attentions=True``,
as a keyword or in its config) all-gathered over tp along the heads, with autograd, into the whole
model's (``(batch, heads, query, key)`` per layer); a head count neither the config's nor its tp-th is
refused, naming it: dtlab does not guess.

:func:`head_count_hint`: torch's raw view error ("shape [...] is invalid for input of size N") from a
user's attention reshaping a split projection by the whole model's head count (``q.view(b, t,
self.n_heads, head_dim)``), re-raised naming the fixes where the shape would fit ``tp`` times the input
(a whole width asked of a split tensor); any other error (a user's own bug) keeps torch's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TypeGuard

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models.tensor._comm import gather_heads_from_tp

__all__ = ["head_count_hint", "whole_attentions"]

#: a model output's fields holding attention weights, with the config's head counts each may have
_FIELDS = {
    "attentions": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "encoder_attentions": ("encoder_attention_heads", "num_attention_heads", "num_heads"),
    "decoder_attentions": ("decoder_attention_heads", "num_attention_heads", "num_heads"),
    "cross_attentions": ("decoder_attention_heads", "num_attention_heads", "num_heads"),
}


def whole_attentions(out: Any, module: nn.Module, tp: CommunicationBackend, who: str) -> Any:
    """``out`` (the output of ``module``, a Hugging Face model with a ``config``: a ``ModelOutput``/dict,
    or the tuple of ``return_dict=False``) with every attention-weight tensor of a tp rank's heads
    gathered into the whole model's; ``out`` itself where there are none (no communication), ``tp`` is
    one rank, the module has no config, or a tuple's config names no head count (not a transformer's
    weights: a model of your own with a ``config`` returning feature maps)."""
    config = getattr(module, "config", None)
    if tp.world_size == 1 or config is None:
        return out
    if isinstance(out, MutableMapping):
        for field, names in _FIELDS.items():
            weights = out.get(field)
            if _is_weights(weights):
                out[field] = _gathered(weights, _heads(config, names), tp, who, field)
        return out
    unnamed = tuple({n for ns in _FIELDS.values() for n in ns})  # any of the config's counts
    heads = _heads(config, unnamed)
    if isinstance(out, tuple) and heads and any(_is_weights(part) for part in out):  # without a head
        return type(out)(  # count, 4-D tensors are no attention weights (a model's feature maps)
            _gathered(part, heads, tp, who, f"output[{i}]") if _is_weights(part) else part
            for i, part in enumerate(out)
        )
    return out


def _is_weights(value: Any) -> TypeGuard[tuple[torch.Tensor, ...]]:
    """A tuple of 4-D floating tensors: one ``(batch, heads, query, key)`` per layer."""
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() for t in value)
    )


def _heads(config: Any, names: tuple[str, ...]) -> set[int]:
    found = (getattr(config, n, None) for n in names)
    return {h for h in found if isinstance(h, int) and h > 0}


def _gathered(
    weights: tuple[torch.Tensor, ...], heads: set[int], tp: CommunicationBackend, who: str, field: str
) -> tuple[torch.Tensor, ...]:
    p, out = tp.world_size, []
    for i, w in enumerate(weights):
        here = w.shape[1]
        if here in heads and here * p not in heads:  # a layer the plan leaves whole
            out.append(w)
        elif here * p in heads and here not in heads:  # this rank's heads, in order: concatenated
            out.append(gather_heads_from_tp(w, tp))
        else:
            raise StrategyError(
                f"{who}: the model returned attention weights ({field}, layer {i}) of {here} heads, and "
                f"its config's head counts are {sorted(heads)}: under tp={p} dtlab cannot tell whether "
                "they are this rank's heads or the whole layer's. Leave output_attentions off (the "
                "keyword and config.output_attentions), or compute them on the plain model loaded from "
                "model.state_dict()"
            )
    return tuple(out)


_VIEW_ERROR = re.compile(r"shape '\[([-\d, ]*)\]' is invalid for input of size (\d+)")


def _whole_width(message: str, tp: int) -> bool:
    """Whether torch's view error in ``message`` asks a shape that ``tp`` times the input would fill."""
    found = _VIEW_ERROR.search(message)
    if found is None:
        return False
    dims = [int(d) for d in found.group(1).split(",") if d.strip()]
    whole, known = int(found.group(2)) * tp, math.prod(d for d in dims if d != -1)
    if -1 in dims:
        return known > 0 and whole % known == 0
    return known == whole


@contextmanager
def head_count_hint(who: str, tp: int) -> Iterator[None]:
    """Around a forward of ``who`` split over ``tp`` ranks (nothing at ``tp == 1``)."""
    try:
        yield
    except RuntimeError as exc:
        if tp == 1 or not _whole_width(str(exc), tp):
            raise
        raise StrategyError(
            f"{who}: {exc}. At tp={tp} each rank's column-split projections ('colwise') hold 1/{tp} of "
            "their output features (this rank's heads), so a forward that reshapes them by the whole "
            "model's head count or width (q.view(b, t, self.n_heads, d // self.n_heads), "
            "y.reshape(b, t, d)) fails. Reshape by this rank's shape instead: -1 for the heads and a "
            "fixed head_dim (q.view(b, t, -1, self.head_dim)), -1 for the attention's output width "
            "(y.reshape(b, t, -1)); or split the attention with HeadsParallel(qkv=..., out=..., "
            f"heads='<its head-count attribute>', sections=1), which sets that attribute to heads // {tp} "
            "on each rank. plan='auto' handles Hugging Face models"
        ) from exc
