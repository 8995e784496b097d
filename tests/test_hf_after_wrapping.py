"""Hugging Face calls made on the model after a data-parallel strategy wrapped it, on 2 in-memory ranks:
``resize_token_embeddings`` on the wrapped model replaces the embedding's and the head's ``.data`` by
tensors of another shape, which the strategy's buckets and shards were not laid out for (DDP, ZeRO-1
and ZeRO-2 stopped in backward with autograd's raw size error): refused at the next forward with
gradients, naming the parameter, the call and the fix, under DDP, ZeRO-1/2/3 and FSDP; resized before
wrapping it trains as one process. Tiny configs in memory (no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_cases import VOCAB, llama, rel_error, token_batch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import DDPModel, FSDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero3": (ZeRO3Model, ZeRO3Optimizer),
    "fsdp": (FSDPModel, ZeRO3Optimizer),
}
GROWN = VOCAB + 8


def _net(resized: bool) -> nn.Module:
    with seeded_init(0):  # the new rows drawn from torch's global RNG too
        net = llama()
        if resized:
            net.resize_token_embeddings(GROWN, mean_resizing=False)
    return net


def _options(name: str) -> dict[str, Any]:
    return {"persistence_threshold": 0} if name == "zero3" else {}


def _resized(backend: CommunicationBackend) -> dict[str, Any]:
    x, _ = token_batch(4, seed=1)
    xs = x.chunk(2)[backend.rank]
    out: dict[str, Any] = {}
    for name, (wrapper, optimizer) in STRATEGIES.items():
        net = _net(resized=False)
        model = wrapper(net, backend, **_options(name))
        net.resize_token_embeddings(GROWN, mean_resizing=False)  # on the wrapped model
        with pytest.raises(StrategyError) as info:
            model(xs, labels=xs).loss.backward()
        out[f"{name}/after"] = str(info.value)
        model = wrapper(_net(resized=True), backend, **_options(name))  # the fix: resized before wrapping
        opt = optimizer(model, torch.optim.SGD, lr=0.5)
        for _ in range(2):
            model(xs, labels=xs).loss.backward()
            opt.step()
            opt.zero_grad()
        out[f"{name}/before"] = model.state_dict()
    return out


def test_resize_token_embeddings_after_wrapping_is_refused_naming_the_fix() -> None:
    ref = _net(resized=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, _ = token_batch(4, seed=1)
    for _ in range(2):  # the mean of the two halves' losses, as the 2 ranks average their gradients
        sum(ref(h, labels=h).loss / 2 for h in x.chunk(2)).backward()
        opt.step()
        opt.zero_grad()
    for res in run_world(2, _resized, timeout=120):
        for name, (wrapper, _) in STRATEGIES.items():
            got = res[f"{name}/after"]
            assert f"{wrapper.__name__}: parameter 'model.embed_tokens.weight' had its .data replaced" in got
            assert f"tensor of shape ({GROWN}, 16), not its ({VOCAB}, 16)" in got, got
            assert "resize_token_embeddings(n) on the wrapped model" in got, got
            assert "hf_model.resize_token_embeddings(n), then wrap" in got, got
            state = res[f"{name}/before"]
            assert max(rel_error(state[k], v) for k, v in ref.state_dict().items()) <= 1e-5, name
