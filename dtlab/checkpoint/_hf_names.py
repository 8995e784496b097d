"""The names a Hugging Face checkpoint gives a model's tensors, as ``from_pretrained`` reads them.

A checkpoint of the base model (``GPT2Model``: ``h.0.attn.c_attn.weight``, as the Hub's ``gpt2`` is
saved) names the tensors of a model with a head (``GPT2LMHeadModel``:
``transformer.h.0.attn.c_attn.weight``) without the model's ``base_model_prefix``, and a checkpoint of a
model with a head names a base model's tensors with it. Old checkpoints also hold tensors the model no
longer keeps in its state (GPT-2's causal-mask ``attn.bias``, per-layer rotary ``inv_freq``,
``position_ids``): ``from_pretrained`` ignores them, by the model's ``_keys_to_ignore_on_load_unexpected``
and those two patterns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

__all__ = ["file_names", "ignored_unexpected"]


def file_names(module: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """The model's name of each of the file's ``keys`` (only those that differ): the model's
    ``base_model_prefix`` added to a base model's checkpoint loaded into a model with a head, or removed
    from a checkpoint with a head loaded into a base model. Empty for any other model or file."""
    prefix = getattr(module, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return {}
    keys = list(keys)
    dotted = prefix + "."
    with_prefix = [k for k in keys if k.startswith(dotted)]
    if isinstance(getattr(module, prefix, None), nn.Module):  # a model with a head around its base
        return {} if with_prefix else {k: dotted + k for k in keys}
    return {k: k[len(dotted) :] for k in with_prefix}


def ignored_unexpected(module: nn.Module) -> re.Pattern[str] | None:
    """The file keys ``from_pretrained`` ignores when the model has no tensor of that name."""
    patterns: set[str] = set()
    for mod in module.modules():
        patterns.update(getattr(mod, "_keys_to_ignore_on_load_unexpected", None) or ())
    if not patterns and not hasattr(module, "base_model_prefix"):
        return None  # not a Hugging Face model
    buffers = [n for n, _ in module.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None
