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
from hf_cases import (
    decoder_layer,
    gpt2,
    llama,
    lm_loss,
    rel_error,
    save_one_and_sharded,
    token_batch,
    train_steps,
    worst_loss_error,
)
from pretrained_cases import assert_loaded_bitwise, load_into
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import HybridShardedModel, ModuleClassPolicy, PipelineParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")

STEPS = 3
SPLIT = {"llama": "model.layers.1", "gpt2": "transformer.h.1"}


def _build(name: str) -> nn.Module:
    # Llama: 4 query heads, 2 key/value heads: each tp=2 rank gets 2 and 1
    return llama(heads=4, kv_heads=2) if name == "llama" else gpt2()


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
        wrap_policy=ModuleClassPolicy((decoder_layer(name),)), init_seed=3,
    )  # fmt: skip
    return model, ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1), mesh


def _cases() -> list[tuple[str, str]]:
    return [(name, src) for name in ("llama", "gpt2") for src in ("one", "sharded")]


def _load_all(backend: CommunicationBackend, root: Path, wrap: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = token_batch(4, seed=2)
    for name, src in _cases():
        key = f"{name}/{src}"
        model, opt, mesh = _wrapped(name, wrap, backend)
        out[f"{key}/load"] = load_into(model, root / f"{name}-{src}")
        if wrap == "pp2":  # the copies this rank holds, whole (GPT-2: wte on stage 0, the tied head on 1)
            out[f"{key}/local"] = {
                n: q.detach().clone() for n, q in model.module.named_parameters(remove_duplicate=False)
            }
        c, n = (mesh.coordinate("dp"), mesh.size("dp")) if mesh is not None else (0, 1)
        losses = []
        for _ in range(STEPS):
            losses.append(model.train_step((x.chunk(n)[c], y.chunk(n)[c]), lm_loss).item())
            opt.step()
            opt.zero_grad()
        out[f"{key}/losses"] = losses
        out[f"{key}/trained"] = model.full_state_dict()
    return out


def test_hugging_face_checkpoints_load_bitwise_into_pipelines_and_train_like_one_process(
    tmp_path: Path,
) -> None:
    refs = {}
    x, y = token_batch(4, seed=2)
    for name in ("llama", "gpt2"):
        with seeded_init(11):
            net = _build(name)
        save_one_and_sharded(net, tmp_path, name)
        saved = {k: v.clone() for k, v in net.state_dict().items()}
        losses = train_steps(net, torch.optim.SGD(net.parameters(), lr=0.1), x, y, STEPS)
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
            assert worst_loss_error(mean, ref_losses) <= 1e-5, key
            for res in results:
                assert_loaded_bitwise(res[f"{k}/load"], saved, key)
                local = res.get(f"{k}/local", {})
                assert [n for n in local if not torch.equal(local[n], saved[n])] == [], key
                for n, v in ref_state.items():
                    rel = rel_error(res[f"{k}/trained"][n], v)
                    assert rel <= 1e-5, (key, n, rel)
