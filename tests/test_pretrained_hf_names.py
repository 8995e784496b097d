"""``load_pretrained`` reads a Hugging Face checkpoint's names as ``from_pretrained`` does: a base model's
checkpoint (``GPT2Model``'s keys, without ``transformer.``, as the Hub's ``gpt2`` is saved, with its old
causal-mask ``attn.bias`` tensors) loads into ``GPT2LMHeadModel`` built on meta under ZeRO-3, tensor and
pipeline parallelism, bitwise ``from_pretrained``'s model; a checkpoint with a head loads into the base
model (its head reported unexpected)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_cases import SEQ, gpt2, gpt2_wrapped_on_meta, llama
from safetensors.torch import load_file, save_file

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import load_pretrained
from dtlab.core import seeded_init
from dtlab.models import ZeRO3Model
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")


def test_a_base_models_checkpoint_loads_into_the_model_with_a_head_as_from_pretrained(tmp_path: Path) -> None:
    config = gpt2().config
    with seeded_init(5):
        base = transformers.GPT2Model(config)
    base.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert "h.0.attn.c_attn.weight" in weights  # no "transformer." prefix
    for i in range(config.n_layer):  # what old GPT-2 checkpoints hold besides the weights
        weights[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, SEQ, SEQ))
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    want = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()

    def body(backend: CommunicationBackend) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for wrap in ("zero3", "tp2", "pp2"):
            model = gpt2_wrapped_on_meta(wrap, backend, 0)
            out[f"{wrap}/report"] = load_pretrained(model, tmp_path)
            out[wrap] = model.full_state_dict()
        return out

    for res in run_world(2, body):
        for wrap in ("zero3", "tp2", "pp2"):
            assert res[f"{wrap}/report"].unexpected == [], wrap  # attn.bias: ignored as from_pretrained does
            assert [k for k in want if not torch.equal(res[wrap][k], want[k])] == [], wrap


def test_a_checkpoint_with_a_head_loads_into_the_base_model(tmp_path: Path) -> None:
    with seeded_init(6):
        head = llama(tie_word_embeddings=False)
    head.save_pretrained(tmp_path)
    want = transformers.LlamaModel.from_pretrained(tmp_path).state_dict()
    config = head.config

    def body(backend: CommunicationBackend) -> tuple[Any, dict[str, torch.Tensor]]:
        with torch.device("meta"):
            net = transformers.LlamaModel(config)
        model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=0)
        return load_pretrained(model, tmp_path, strict=False), model.full_state_dict()

    for report, state in run_world(2, body):
        assert (report.missing, report.unexpected) == ([], ["lm_head.weight"])
        assert [k for k in want if not torch.equal(state[k], want[k])] == []
