"""``load_pretrained`` into Hugging Face models split by a pipeline: a tiny LlamaForCausalLM and
GPT2LMHeadModel (its head tied to the token embedding, the two on different stages) written by
``save_pretrained`` (one file, and sharded with a small ``max_shard_size``), built on the meta device,
wrapped at pp 2 (1F1B, split at the second decoder layer) and at dp 2 x tp 2 x pp 2 (FSDP per decoder
layer, the model's own tensor plan), loaded on in-memory ranks: bitwise the saved weights (the tied
copies too), and 3 SGD steps as single-process training from the same weights (rel <= 1e-5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import load_pretrained
from dtlab.core import seeded_init
from dtlab.models import HybridShardedModel, ModuleClassPolicy, PipelineParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS = 32, 8, 3
SPLIT = {"llama": "model.layers.1", "gpt2": "transformer.h.1"}


def _build(name: str) -> nn.Module:
    if name == "llama":  # 4 query heads, 2 key/value heads: each tp=2 rank gets 2 and 1
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
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


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _wrapped(name: str, wrap: str, backend: CommunicationBackend) -> tuple[Any, Any, Mesh | None]:
    """The model built on meta (values of no importance: all is loaded), wrapped, with its optimizer."""
    with torch.device("meta"):
        net = _build(name)
    if wrap == "pp2":
        model: Any = PipelineParallelModel(
            net, backend, "1f1b", micro_batches=2, split_points=[SPLIT[name]], init_seed=3
        )
        return model, DDPOptimizer(model, torch.optim.SGD, lr=0.1), None
    mesh = Mesh(backend, {"pp": 2, "dp": 2, "tp": 2})
    model = HybridShardedModel(
        net, mesh, "fsdp", tensor_plan="auto", schedule="1f1b", micro_batches=2, split_points=[SPLIT[name]],
        wrap_policy=ModuleClassPolicy((_layer(name),)), init_seed=3,
    )  # fmt: skip
    return model, ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1), mesh


def _cases() -> list[tuple[str, str]]:
    return [(name, src) for name in ("llama", "gpt2") for src in ("one", "sharded")]


def _load_all(backend: CommunicationBackend, root: Path, wrap: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = _batch()
    for name, src in _cases():
        key = f"{name}/{src}"
        model, opt, mesh = _wrapped(name, wrap, backend)
        report = load_pretrained(model, root / f"{name}-{src}")
        out[f"{key}/report"] = (report.missing, report.unexpected, report.mismatched)
        out[f"{key}/loaded"] = model.full_state_dict()
        if wrap == "pp2":  # the copies this rank holds, whole (GPT-2: wte on stage 0, the tied head on 1)
            out[f"{key}/local"] = {
                n: q.detach().clone() for n, q in model.module.named_parameters(remove_duplicate=False)
            }
        c, n = (mesh.coordinate("dp"), mesh.size("dp")) if mesh is not None else (0, 1)
        losses = []
        for _ in range(STEPS):
            losses.append(model.train_step((x.chunk(n)[c], y.chunk(n)[c]), _loss).item())
            opt.step()
            opt.zero_grad()
        out[f"{key}/losses"] = losses
        out[f"{key}/trained"] = model.full_state_dict()
    return out


def test_hugging_face_checkpoints_load_bitwise_into_pipelines_and_train_like_one_process(
    tmp_path: Path,
) -> None:
    refs = {}
    x, y = _batch()
    for name in ("llama", "gpt2"):
        with seeded_init(11):
            net = _build(name)
        net.save_pretrained(tmp_path / f"{name}-one")
        net.save_pretrained(tmp_path / f"{name}-sharded", max_shard_size="4KB")
        assert (tmp_path / f"{name}-sharded" / "model.safetensors.index.json").is_file()
        saved = {k: v.clone() for k, v in net.state_dict().items()}
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for _ in range(STEPS):
            loss = _loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        refs[name] = (saved, losses, net.state_dict())
    assert "lm_head.weight" in refs["gpt2"][0]  # tied to transformer.wte.weight, saved once
    for wrap, world in (("pp2", 2), ("dp2xtp2xpp2", 8)):
        results = run_world(world, _load_all, tmp_path, wrap, timeout=300)
        if wrap == "pp2":
            assert "lm_head.weight" in results[1]["gpt2/one/local"]  # the last stage's copy, checked
        for name, src in _cases():
            key = f"{wrap}/{name}/{src}"
            saved, ref_losses, ref_state = refs[name]
            k = f"{name}/{src}"  # the mean over the ranks is the dp shards' mean (pp, tp replicate it)
            mean = [sum(v) / world for v in zip(*(res[f"{k}/losses"] for res in results), strict=True)]
            assert max(abs(a - b) / abs(b) for a, b in zip(mean, ref_losses, strict=True)) <= 1e-5, key
            for res in results:
                assert res[f"{k}/report"] == ([], [], []), key
                loaded = res[f"{k}/loaded"]
                assert sorted(loaded) == sorted(saved), key
                assert [n for n in saved if not torch.equal(loaded[n], saved[n])] == [], key
                local = res.get(f"{k}/local", {})
                assert [n for n in local if not torch.equal(local[n], saved[n])] == [], key
                for n, v in ref_state.items():
                    rel = ((res[f"{k}/trained"][n] - v).norm() / v.norm().clamp_min(1e-12)).item()
                    assert rel <= 1e-5, (key, n, rel)
