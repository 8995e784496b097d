"""``output_attentions=True`` on a Hugging Face model under tensor parallelism (tp=2, ``plan="auto"``,
eager attention): each tp rank computes the weights of its own heads only, and the wrapper returned
those (2 of Llama's 4 heads per layer, different on each rank; a loss reading them trained to 7e-2
relative error on the parameters after 2 steps). Now they are gathered over tp into the whole model's,
with autograd: the weights equal one process's, and a loss on them (attention distillation) trains as
one process does, for a decoder (Llama, the keyword and the tuple of ``return_dict=False``) and an
encoder-decoder (BART: encoder, decoder and cross attentions). Weights whose head count is neither the
config's nor its tp-th are refused, naming it. Tiny configs in memory (no network)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hf_cases import family, llama, lm_loss, rel_error, token_batch

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world

pytest.importorskip("transformers")

STEPS, LR = 2, 0.5
FIELDS = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")


def _built(name: str) -> Any:
    with seeded_init(0):
        net = llama(hidden=32, heads=4, kv_heads=2) if name == "llama" else family("bart")
    net.set_attn_implementation("eager")  # the implementation that returns its weights
    return net.double()


def _weights(out: Any) -> list[torch.Tensor]:
    if isinstance(out, tuple):  # return_dict=False: (logits, the cache, attentions)
        return list(out[-1])
    return [w for f in FIELDS if getattr(out, f, None) is not None for w in getattr(out, f)]


def _call(model: Any, name: str, x: torch.Tensor, tuple_out: bool = False) -> Any:
    extra = {"decoder_input_ids": x} if name == "bart" else {}
    return model(x, output_attentions=True, return_dict=not tuple_out, **extra)


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out[0] if isinstance(out, tuple) else out
    return lm_loss(logits, y) + sum(
        (w.pow(2).mean() for w in _weights(out)), torch.zeros((), dtype=torch.float64)
    )


def _train(model: Any, opt: Any, name: str, tuple_out: bool) -> tuple[list[torch.Tensor], list[float]]:
    x, y = token_batch(4, seed=1)
    with torch.no_grad():
        first = [w.clone() for w in _weights(_call(model, name, x, tuple_out))]
    losses = []
    for _ in range(STEPS):
        loss = _loss(_call(model, name, x, tuple_out), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return first, losses


CASES = [("llama", False), ("llama", True), ("bart", False)]


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tuple_out in CASES:
        model = TensorParallelModel(_built(name), backend, plan="auto")
        first, losses = _train(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), name, tuple_out)
        out[f"{name}/{tuple_out}"] = (first, losses, model.full_state_dict())
    odd = _built("llama")
    odd.config.num_attention_heads = 3  # a config that matches neither the whole nor the split heads
    model = TensorParallelModel(odd, backend, plan="auto")
    with pytest.raises(StrategyError) as info:
        _call(model, "llama", token_batch(2, seed=2)[0])
    out["refused"] = str(info.value)
    return out


def test_attention_weights_under_tp_are_the_whole_models_and_train_as_one_process() -> None:
    results = run_world(2, _world, timeout=120)
    for name, tuple_out in CASES:
        net = _built(name)
        first, losses = _train(net, torch.optim.SGD(net.parameters(), lr=LR), name, tuple_out)
        assert len(first) == (2 if name == "llama" else 6)
        for r in results:
            got_first, got_losses, state = r[f"{name}/{tuple_out}"]
            assert [w.shape for w in got_first] == [w.shape for w in first]  # 4 heads, not 2
            assert max(rel_error(g, w) for g, w in zip(got_first, first, strict=True)) < 1e-12
            assert max(abs(a - b) / b for a, b in zip(got_losses, losses, strict=True)) < 1e-10
            # (a key bias's gradient is 0 in exact arithmetic: round-off only, on a bias that starts at 0)
            worst = max((rel_error(state[k], v), k) for k, v in net.state_dict().items() if v.norm() > 1e-2)
            assert worst[0] < 1e-10, (name, worst)
    assert all(
        "attention weights (attentions, layer 0) of 2 heads, and its config's head counts are [3]"
        in r["refused"]
        for r in results
    )


class _Maps(torch.nn.Module):
    """A model of one's own with a ``config`` (no head count) returning ``(logits, (feature maps,))``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_classes=4)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        maps = self.conv(x)
        return self.fc2(self.fc1(maps.mean((2, 3))).relu()), (maps,)


def _feature_maps(backend: CommunicationBackend) -> list[torch.Tensor]:
    with seeded_init(0):
        net = _Maps()
    model = TensorParallelModel(net, backend, plan={"fc1": "colwise", "fc2": "rowwise"})
    logits, (maps,) = model(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)))
    return [logits, maps]


def test_feature_maps_of_a_model_whose_config_names_no_heads_pass_through() -> None:
    """4-D tensors in a tuple beside the logits were taken for attention weights and refused ('attention
    weights (output[1], layer 0) of 8 heads, and its config's head counts are []')."""
    with seeded_init(0):
        net = _Maps()
    want = net(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)))
    for logits, maps in run_world(2, _feature_maps, timeout=30):
        torch.testing.assert_close(logits, want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(maps, want[1][0], rtol=0, atol=0)
