"""``load_pretrained`` on Hugging Face models: a tiny LlamaForCausalLM and GPT2LMHeadModel (tied head)
written by ``save_pretrained`` (one file, and sharded with a small ``max_shard_size``), built on the
meta device, wrapped in ZeRO-3 and FSDP per decoder layer (and tensor parallel 2 for Llama, built
plainly), loaded on 2 in-memory ranks: bitwise the saved weights, the rotary buffer as built plainly,
and 3 SGD steps as single-process training from the same weights (rel <= 1e-5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import load_pretrained
from dtlab.core import seeded_init
from dtlab.models import FSDPModel, ModuleClassPolicy, TensorParallelModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS = 32, 8, 3
#: tensor parallelism in Hugging Face's style names (as in test_hf_models)
LLAMA_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def _build(name: str) -> nn.Module:
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
        )  # fmt: skip
        llama: nn.Module = transformers.LlamaForCausalLM(config)
        return llama
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    gpt2: nn.Module = transformers.GPT2LMHeadModel(config)
    return gpt2


def _layer(name: str) -> type[nn.Module]:
    layer: type[nn.Module] = (
        transformers.models.llama.modeling_llama.LlamaDecoderLayer
        if name == "llama"
        else transformers.models.gpt2.modeling_gpt2.GPT2Block
    )
    return layer


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    seqs = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return seqs[:, :-1], seqs[:, 1:]


def _train(model: Any, opt: Any, lo: int, hi: int) -> list[float]:
    x, y = _batch()
    losses = []
    for _ in range(STEPS):
        logits = model(x[lo:hi]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y[lo:hi].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _wrapped(name: str, wrap: str, backend: CommunicationBackend) -> tuple[Any, Any, nn.Module]:
    """The model built on meta (tp: plainly, random values) and wrapped, with its optimizer."""
    if wrap == "tp2":
        with seeded_init(backend.rank + 7):  # values of no importance: every tensor is loaded
            net = _build(name)
        model: Any = TensorParallelModel(net, backend, plan=LLAMA_PLAN)
        return model, DDPOptimizer(model, torch.optim.SGD, lr=0.1), net
    with torch.device("meta"):
        net = _build(name)
    init = net._init_weights  # Hugging Face's per-module initializer (buffers included)
    if wrap == "zero3":
        model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=3, param_init_fn=init)
    else:
        policy = ModuleClassPolicy((_layer(name),))
        model = FSDPModel(net, backend, wrap_policy=policy, init_seed=3, param_init_fn=init)
    return model, ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1), net


def _cases() -> list[tuple[str, str, str]]:
    return [
        (name, src, wrap)
        for name in ("llama", "gpt2")
        for src in ("one", "sharded")
        for wrap in ("zero3", "fsdp", *(["tp2"] if name == "llama" else []))
    ]


def _load_all(backend: CommunicationBackend, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    r, p = backend.rank, backend.world_size
    for name, src, wrap in _cases():
        key = f"{name}/{src}/{wrap}"
        model, opt, net = _wrapped(name, wrap, backend)
        report = load_pretrained(model, root / f"{name}-{src}")
        out[f"{key}/report"] = (report.missing, report.unexpected, report.mismatched)
        out[f"{key}/loaded"] = model.full_state_dict()
        out[f"{key}/buffers"] = {n: b.clone() for n, b in net.named_buffers() if n.endswith("inv_freq")}
        lo, hi = (0, 4) if wrap == "tp2" else (r * 4 // p, (r + 1) * 4 // p)
        out[f"{key}/losses"] = _train(model, opt, lo, hi)
        out[f"{key}/trained"] = model.full_state_dict()
    return out


def test_hugging_face_checkpoints_load_bitwise_into_sharded_models_and_train_like_one_process(
    tmp_path: Path,
) -> None:
    refs = {}
    for name in ("llama", "gpt2"):
        with seeded_init(11):
            net = _build(name)
        net.save_pretrained(tmp_path / f"{name}-one")
        net.save_pretrained(tmp_path / f"{name}-sharded", max_shard_size="4KB")
        assert (tmp_path / f"{name}-sharded" / "model.safetensors.index.json").is_file()
        saved = {k: v.clone() for k, v in net.state_dict().items()}
        buffers = {n: b.clone() for n, b in net.named_buffers() if n.endswith("inv_freq")}
        losses = _train(net, torch.optim.SGD(net.parameters(), lr=0.1), 0, 4)
        refs[name] = (saved, buffers, losses, net.state_dict())
    assert "lm_head.weight" in refs["gpt2"][0]  # tied to transformer.wte.weight, saved once
    results = run_world(2, _load_all, tmp_path, timeout=300)
    for name, src, wrap in _cases():
        key = f"{name}/{src}/{wrap}"
        saved, buffers, ref_losses, ref_state = refs[name]
        mean = [sum(v) / 2 for v in zip(*(res[f"{key}/losses"] for res in results), strict=True)]
        if wrap == "tp2":
            mean = results[0][f"{key}/losses"]
        assert max(abs(a - b) / abs(b) for a, b in zip(mean, ref_losses, strict=True)) <= 1e-5, key
        for res in results:
            assert res[f"{key}/report"] == ([], [], []), key
            loaded = res[f"{key}/loaded"]
            assert sorted(loaded) == sorted(saved), key
            assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == [], key
            assert [k for k in buffers if not torch.equal(res[f"{key}/buffers"][k], buffers[k])] == [], key
            for k, v in ref_state.items():
                rel = ((res[f"{key}/trained"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
                assert rel <= 1e-5, (key, k, rel)
