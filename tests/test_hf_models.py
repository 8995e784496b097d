"""A Hugging Face model from the CLI: the default loss takes ``.logits`` from the model's output (or
a dict's ``"logits"``), a loss that does not fit says what to pass, and ``strategy.fsdp_units`` names
the module classes that become FSDP units. Tiny models built from configs (no network, no weights)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_cases import (
    LLAMA_PLAN,
    SEQ,
    VOCAB,
    llama,
    llama_gqa,
    rel_error,
    tokens,
    train_steps,
    worst_loss_error,
)
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.config import TrainConfig, load_config
from dtlab.errors import ConfigError, DataError, RankFailedError
from dtlab.testing import run_world
from dtlab.trainers import SummedLoss, build_task
from dtlab.trainers.build import build_model_strategy
from dtlab.trainers.custom import task_from_objects
from dtlab.trainers.tasks import cross_entropy_loss, logits_of

BASE = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
BASE += ["data.global_batch_size=8", "train.eval_every=0", "optimizer.warmup_steps=0"]
BASE += ["model.factory=hf_cases:llama", "data.factory=hf_cases:tokens"]


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def test_the_default_loss_takes_logits_from_an_output_that_has_them() -> None:
    logits, y = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    want = cross_entropy_loss(logits, y)
    assert torch.equal(cross_entropy_loss(_Logits(logits), y), want)
    assert torch.equal(cross_entropy_loss({"logits": logits, "loss": None}, y), want)
    assert logits_of(logits) is logits
    with pytest.raises(
        TypeError, match=r"returned a dict with keys \['hidden'\]\. Pass a loss .*model\.loss="
    ):
        logits_of({"hidden": logits})
    with pytest.raises(TypeError, match=r"returned a tuple\. Pass a loss"):
        logits_of((logits,))


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y


def test_a_default_loss_that_does_not_fit_says_what_to_pass() -> None:
    data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(8)]
    with pytest.raises(
        ConfigError, match=r"loss_fn does not fit: .*returned a tuple\. Pass a loss .*loss_fn="
    ):
        task_from_objects(load_config(overrides=BASE[:4]), _Pair(), data)


def _units(backend: CommunicationBackend, config: TrainConfig) -> list[str]:
    model, _ = build_model_strategy(config, backend, build_task(config))
    return [u.key for u in model.shard_units()]  # type: ignore[attr-defined]


def test_fsdp_units_by_class_name_on_a_hugging_face_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    sets = [*BASE, "strategy.model=fsdp", "strategy.fsdp_units=[LlamaDecoderLayer]"]
    units = run_world(2, _units, load_config(overrides=sets), timeout=60)[0]
    assert units == ["<root>", "model.layers.0", "model.layers.1"]
    assert run_world(2, _units, load_config(overrides=[*BASE, "strategy.model=fsdp"]), timeout=60)[0] == [
        "<root>"
    ]
    # the whole run from the CLI: default loss on the model's CausalLMOutputWithPast, FSDP per layer
    assert main(["train", *[a for s in [*sets, "train.steps=2"] for a in ("--set", s)]]) == 0
    for bad, says in [
        (
            "strategy.fsdp_units=[Nope]",
            r"\['Nope'\] name no module class of LlamaForCausalLM; .*'LlamaDecoderLayer'",
        ),
    ]:
        with pytest.raises(RankFailedError) as info:
            run_world(1, _units, load_config(overrides=[*sets, bad]), timeout=60)
        assert isinstance(info.value.__cause__, ConfigError)
        assert re.search(says, str(info.value.__cause__)), info.value.__cause__


def test_fsdp_units_without_fsdp_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"the data-parallel strategy is 'ddp'; use strategy.model=fsdp"):
        load_config(overrides=[*BASE, "strategy.model=ddp", "strategy.fsdp_units=[LlamaDecoderLayer]"])


def _llama_tp(
    backend: CommunicationBackend, state: dict[str, torch.Tensor]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from dtlab.models import TensorParallelModel
    from dtlab.optimizers import DDPOptimizer

    net = llama().double()
    net.load_state_dict(state)
    model = TensorParallelModel(net, backend, plan=LLAMA_PLAN)
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = (torch.stack(t) for t in zip(*tokens()[:4], strict=True))
    losses = train_steps(model, opt, x, y, 3, cross_entropy_loss)  # the head gathers the logits
    return losses, model.full_state_dict()


def test_llama_at_tp2_with_hugging_face_style_names_matches_one_process() -> None:
    pytest.importorskip("transformers")
    net = llama().double()  # float64: Adam's round-off on gradients that are zero in exact arithmetic
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = (torch.stack(t) for t in zip(*tokens()[:4], strict=True))
    ref_losses = train_steps(net, opt, x, y, 3, cross_entropy_loss)
    ref = net.state_dict()
    for losses, full in run_world(2, _llama_tp, state, timeout=60):
        assert worst_loss_error(losses, ref_losses) < 1e-5
        for k, v in ref.items():
            if v.is_floating_point():
                assert rel_error(full[k], v) < 1e-5, k


def _gqa_refused(backend: CommunicationBackend) -> int:
    from dtlab.errors import StrategyError
    from dtlab.models import TensorParallelModel

    try:
        TensorParallelModel(llama_gqa(), backend, plan=LLAMA_PLAN)
    except StrategyError as exc:
        assert "'model.layers.0.self_attn.k_proj' projects 2 attention heads of 8" in str(exc), exc
        assert "tp=4; choose a tp that divides 2" in str(exc)
        return backend.stats.calls
    raise AssertionError("tp=4 over 2 key/value heads was accepted")


def test_grouped_query_attention_with_a_tp_that_splits_a_head_is_refused_before_any_call() -> None:
    pytest.importorskip("transformers")
    assert run_world(4, _gqa_refused, timeout=60) == [0, 0, 0, 0]


def _hf_labels() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hugging Face's way: ``labels`` are the input ids (the prompt's -100), the model shifts them."""
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100
    return list(zip(ids, labels, strict=True))


def _next_token_sum(out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits[:, :-1].float()
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")


def test_hugging_face_labels_under_the_default_loss_are_refused_naming_the_shift() -> None:
    # the default loss compares logits[t] with target[t]: unshifted labels trained the model to repeat
    # its input (loss 0.55 after 20 steps on random tokens over 8 values, below ln 8)
    pytest.importorskip("transformers")
    config = load_config(overrides=BASE[:4])
    with pytest.raises(DataError, match=r"targets equal the inputs .*labels\[1:\].*SummedLoss"):
        task_from_objects(config, llama, _hf_labels())
    shifted = [(x[:-1], y[1:]) for x, y in _hf_labels()]
    assert task_from_objects(config, llama, shifted).classification
    task_from_objects(config, llama, _hf_labels(), loss_fn=SummedLoss(_next_token_sum))  # shifts: fine
