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
from hf_cases import (
    LLAMA_PLAN,
    decoder_layer,
    gpt2,
    llama,
    rel_error,
    save_one_and_sharded,
    token_batch,
    train_steps,
    worst_loss_error,
)
from pretrained_cases import assert_loaded_bitwise, load_into
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import FSDPModel, ModuleClassPolicy, TensorParallelModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")

STEPS = 3


def _build(name: str) -> nn.Module:
    return llama() if name == "llama" else gpt2()


def _train(model: Any, opt: Any, lo: int, hi: int) -> list[float]:
    x, y = token_batch(4, seed=2)
    return train_steps(model, opt, x[lo:hi], y[lo:hi], STEPS)


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
        policy = ModuleClassPolicy((decoder_layer(name),))
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
        out[f"{key}/load"] = load_into(model, root / f"{name}-{src}")
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
        save_one_and_sharded(net, tmp_path, name)
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
        assert worst_loss_error(mean, ref_losses) <= 1e-5, key
        for res in results:
            assert_loaded_bitwise(res[f"{key}/load"], saved, key)
            assert [k for k in buffers if not torch.equal(res[f"{key}/buffers"][k], buffers[k])] == [], key
            for k, v in ref_state.items():
                rel = rel_error(res[f"{key}/trained"][k], v)
                assert rel <= 1e-5, (key, k, rel)
