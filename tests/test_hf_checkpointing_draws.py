"""Hugging Face's own activation checkpointing (``gradient_checkpointing_enable()``) with dropout on
in-memory ranks: its layers call ``torch.utils.checkpoint`` themselves, so without
``context_fn=ReplayedDraws()`` their recomputation draws other masks than the forward's (threads share
torch's global RNG) and the gradients are another forward's. A strategy's training forward refuses
that, naming the fix; dropout 0, evaluation, one-rank worlds (torch's own handling, as in a process)
and layers given ``ReplayedDraws`` train as before."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from hf_cases import SEQ, VOCAB, llama, transformers_module
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import DDPModel, ZeRO3Model
from dtlab.models.checkpointing import ReplayedDraws
from dtlab.testing import run_world

DEFAULT: dict[str, Any] = {}  # gradient_checkpointing_enable() as called without kwargs
REPLAYED = "replayed"  # {"use_reentrant": False, "context_fn": ReplayedDraws()}


def _gpt2(dropout: float) -> nn.Module:
    transformers = transformers_module()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    net: nn.Module = transformers.GPT2LMHeadModel(config)
    return net


def _llama(dropout: float) -> nn.Module:
    return llama(attention_dropout=dropout)  # its only dropout: attention's, a float on each attention


BUILDS = {"gpt2": _gpt2, "llama": _llama}


def _enable(net: Any, kwargs: dict[str, Any] | str | None) -> None:
    """Hugging Face's checkpointing on (by the name of recent transformers, else the older one)."""
    if kwargs is None:
        return
    given = {"use_reentrant": False, "context_fn": ReplayedDraws()} if kwargs == REPLAYED else kwargs
    if hasattr(net, "activation_checkpointing_enable"):
        net.activation_checkpointing_enable(activation_checkpointing_kwargs=given or None)
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=given or None)


def _step(
    backend: CommunicationBackend,
    family: str,
    dropout: float,
    kwargs: Any,
    wrap: Any = DDPModel,
    after: bool = False,
) -> str | None:
    """One training forward and backward (then one evaluation forward) of a tiny ``family`` model with
    Hugging Face's checkpointing enabled with ``kwargs`` (``after``: on ``model.module`` after wrapping):
    the refusal's message, or None."""
    torch.set_num_threads(1)
    with seeded_init(0):
        net: Any = BUILDS[family](dropout)
    _enable(net, None if after else kwargs)
    net.config.use_cache = False
    model = wrap(net.train(), backend)
    _enable(model.module, kwargs if after else None)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(backend.rank))
    try:
        model(x, labels=x).loss.backward()
    except StrategyError as refused:
        return str(refused)
    finally:
        net.eval()
        with torch.no_grad():
            model(x, labels=x)  # evaluation draws nothing: never refused
    return None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("kwargs", [DEFAULT, {"use_reentrant": True}])
def test_hugging_face_checkpointing_with_dropout_on_in_memory_ranks_is_refused(
    family: str, kwargs: dict[str, Any]
) -> None:
    """Trained silently with other recomputed masks than the forward's (GPT-2, dropout 0.3, 2 ranks: 20
    to 31 of 72 masks, gradients 1.4 to 2.5 off): now refused at the first training forward, naming
    the layer, its dropout and the fixes."""
    transformers_module()  # imported before the ranks start (its lazy import is not thread-safe)
    for message in run_world(2, _step, family, 0.3, kwargs, timeout=120):
        assert message is not None, "not refused"
        layer = "model.layers.0 (LlamaDecoderLayer)" if family == "llama" else "transformer.h.0 (GPT2Block)"
        assert f"DDPModel: Hugging Face's activation checkpointing is on for {layer}" in message
        dropout = "self_attn.attention_dropout=0.3" if family == "llama" else "attn.attn_dropout.p=0.3"
        assert f"which draws dropout ({dropout})" in message
        assert '"context_fn": ReplayedDraws()}' in message
        assert "set the dropout to 0, or run the ranks as processes (gloo)" in message


def test_under_zero3_too_and_enabled_after_wrapping() -> None:
    transformers_module()
    zero3 = partial(ZeRO3Model, persistence_threshold=0)
    assert all(run_world(2, _step, "gpt2", 0.3, DEFAULT, zero3, timeout=120))
    assert all(run_world(2, _step, "llama", 0.3, DEFAULT, DDPModel, True, timeout=120))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_dropout_zero_replayed_draws_and_a_one_rank_world_are_not_refused(family: str) -> None:
    """Dropout 0 draws nothing; ``ReplayedDraws`` replays the forward's masks (tested on GPT-2 in
    test_checkpointing_draws); a one-rank world runs on the caller's thread, as a rank in a process:
    torch's own handling is exact there."""
    transformers_module()
    assert run_world(2, _step, family, 0.0, DEFAULT, timeout=120) == [None, None]
    assert run_world(2, _step, family, 0.3, REPLAYED, timeout=120) == [None, None]
    assert run_world(1, _step, family, 0.3, DEFAULT, timeout=120) == [None]
