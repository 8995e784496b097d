"""Hugging Face's own activation checkpointing (``model.gradient_checkpointing_enable()``, or
``activation_checkpointing_enable()`` in transformers 5) on in-memory ranks: refused where it would
recompute other dropout masks than its forward's.

Hugging Face's layers call ``torch.utils.checkpoint`` themselves, with the keyword arguments the user
gave. In-memory ranks are threads sharing torch's global RNG, so without
:class:`~dtlab.core.replayed_draws.ReplayedDraws` as their ``context_fn`` a layer that draws (dropout
> 0) recomputes other masks than its forward's, and the gradients are those of another forward than
the loss's. A model strategy's training forward on a :class:`~dtlab.backends.threads.RankThread`
refuses that case, naming the fixes; a one-rank world, processes, dropout 0, evaluation and layers
given ``ReplayedDraws`` run as they are.

What is read of transformers (4.35 and later, where ``gradient_checkpointing_kwargs`` appeared, through
5.x): each module's ``gradient_checkpointing`` flag (what ``model.is_activation_checkpointing`` reads)
and the function Hugging Face sets beside it, ``_gradient_checkpointing_func`` (the ``functools.partial``
of ``torch.utils.checkpoint`` with the user's keyword arguments, as ``GradientCheckpointingLayer``
documents it): its ``context_fn`` tells whether the draws are replayed. A module's dropout is an
``nn.Dropout`` with ``p > 0`` or a number attribute named ``*drop*`` above 0 (Llama's
``attention_dropout``, BART's ``dropout`` and ``activation_dropout``, a drop path's ``drop_prob``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dtlab.backends.threads import on_rank_thread
from dtlab.core.replayed_draws import ReplayedDraws
from dtlab.errors import StrategyError

__all__ = ["UnreplayedDraws", "unreplayed_draws"]

#: the attribute of a Hugging Face module that turns its checkpointing on
_FLAG = "gradient_checkpointing"
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout(module: nn.Module) -> str | None:
    """The first dropout above 0 in ``module`` (``name=p``), or ``None``."""
    for name, m in module.named_modules():
        if isinstance(m, _DROPOUTS) and m.p > 0:
            return f"{name or type(module).__name__}.p={m.p}"
        for attr, value in vars(m).items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if "drop" in attr and not attr.startswith("_") and numeric and value > 0:
                return f"{f'{name}.' if name else ''}{attr}={value}"
    return None


def _replayed(module: nn.Module) -> bool:
    """Whether Hugging Face's checkpoint function of ``module`` runs with ``context_fn=ReplayedDraws()``."""
    func = getattr(module, f"_{_FLAG}_func", None)
    keywords = func.keywords if isinstance(func, functools.partial) else {}
    return isinstance(keywords.get("context_fn"), ReplayedDraws)


class UnreplayedDraws:
    """The modules of a model that Hugging Face may checkpoint and that draw (dropout > 0), with their
    dropout; :meth:`check` refuses a training forward on an in-memory rank while one of them is
    checkpointed without :class:`ReplayedDraws`."""

    def __init__(self, layers: list[tuple[str, nn.Module, str]]) -> None:
        self.layers = layers

    def check(self, who: str) -> None:
        if not on_rank_thread() or not torch.is_grad_enabled():
            return
        for name, layer, dropout in self.layers:
            if getattr(layer, _FLAG) is True and layer.training and not _replayed(layer):
                raise StrategyError(
                    f"{who}: Hugging Face's activation checkpointing is on for {name} "
                    f"({type(layer).__name__}), which draws dropout ({dropout}), on in-memory ranks: they "
                    "are threads sharing torch's global RNG, so its recomputation in backward would draw "
                    "other masks than its forward and the gradients would be another forward's. Enable it "
                    "with the replayed draws: model.gradient_checkpointing_enable(gradient_checkpointing_"
                    'kwargs={"use_reentrant": False, "context_fn": ReplayedDraws()}) (from '
                    "dtlab.models.checkpointing import ReplayedDraws; activation_checkpointing_enable("
                    "activation_checkpointing_kwargs=...) in transformers 5), or set the dropout to 0, or "
                    "run the ranks as processes (gloo)"
                )


def unreplayed_draws(module: nn.Module) -> UnreplayedDraws | None:
    """What :class:`UnreplayedDraws` checks in ``module`` (``None``: nothing: no module Hugging Face may
    checkpoint draws random numbers). Of nested such modules the innermost are checked (in transformers
    5 the layers, where the model's own flag only turns its cache off)."""
    flagged = [(n, m) for n, m in module.named_modules() if isinstance(getattr(m, _FLAG, None), bool)]
    ids = {id(m) for _, m in flagged}
    layers = []
    for name, m in flagged:
        holds_flagged = any(id(inner) in ids for inner in m.modules() if inner is not m)
        dropout = None if holds_flagged else _dropout(m)
        if dropout is not None:
            layers.append((name or type(m).__name__, m, dropout))
    return UnreplayedDraws(layers) if layers else None
