"""Pipelines for any model: Hugging Face Llama and GPT-2 (tied) split at module names, under every
schedule, against single-process AdamW on the same global batch (float64); the tied copies bitwise
equal after every step; what the split refuses, named. Tiny configs in memory (no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel, PipelineParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world
from dtlab.trainers.tasks import logits_of

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS, LR = 32, 8, 8, 3, 1e-2
LLAMA_POINTS = {2: ["model.layers.2"], 4: ["model.layers.1", "model.layers.2", "model.layers.3"]}
GPT2_POINTS = {2: ["transformer.h.1"], 4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"]}


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()  # type: ignore[no-any-return]


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    net = transformers.GPT2LMHeadModel(config).double()
    assert net.lm_head.weight is net.transformer.wte.weight
    return net  # type: ignore[no-any-return]


MODELS = {"llama": (llama, LLAMA_POINTS), "gpt2": (gpt2, GPT2_POINTS)}


def initial(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    net = MODELS[name][0]()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def build(name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    net = MODELS[name][0]()
    net.load_state_dict(state)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference(name: str, state: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = build(name, state)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tied_equal(model: HybridShardedModel) -> bool:
    """Every copy of every tied weight on this rank equals the first pipeline rank's (collective)."""
    ok = True
    for tie in model._layout.ties:
        if tie.group is None or tie.param is None:
            continue
        first = tie.param.detach().clone()
        tie.group.broadcast(first, 0)
        ok = ok and torch.equal(first, tie.param.detach())
    return ok


def _pipeline(backend: CommunicationBackend, name: str, state: dict[str, torch.Tensor], schedule: str) -> Any:
    v = 2 if schedule == "interleaved_1f1b" else 1
    model = PipelineParallelModel(
        build(name, state), backend, schedule, micro_batches=4, split_points=MODELS[name][1][2 * v],
        stages_per_rank=v,
    )  # fmt: skip
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=LR)
    x, y = batch()
    losses, tied = [], []
    for _ in range(STEPS):
        losses.append(model.train_step((x, y), loss_fn).item())
        opt.step()
        opt.zero_grad()
        tied.append(_tied_equal(model))
    return {"losses": losses, "state": model.full_state_dict(), "tied": tied, "ties": len(model._layout.ties)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_split_at_module_names_matches_one_process(name: str, schedule: str) -> None:
    state = initial(name)
    ref_losses, ref_state = reference(name, state)
    out = run_world(2, _pipeline, name, state, schedule, timeout=120)
    for r in out:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses, strict=True)) <= 1e-5
        assert set(r["state"]) == set(ref_state)
        assert max(rel(r["state"][k], ref_state[k]) for k in ref_state) <= 1e-5
        assert all(r["tied"]), "the copies of a tied weight differ after a step"
        assert r["ties"] == (1 if name == "gpt2" else 0)
