"""Trainer checks that need data, gradients or the scheduler: data too small for the config is a
ConfigError before any rank starts; a non-finite gradient behind a finite loss on one rank skips the
step everywhere; scheduler state that JSON cannot hold unchanged is refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dtlab.checkpoint.files import check_json
from dtlab.config import load_config
from dtlab.data import TensorDataset
from dtlab.errors import CheckpointError, ConfigError, RankFailedError
from dtlab.trainers import Task, run_training
from dtlab.trainers.models import DigitsCNN

DIGITS = [
    "backend.name=inmemory",
    "model.name=digits_cnn",
    "data.dataset=digits",
    "data.global_batch_size=8",
    "data.shuffle=false",
    "logging.progress=false",
    "train.eval_every=0",
]


def _loss_nan_gradient_on_marked_samples(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy; where a target is -1 (a marked sample) the loss stays finite but its gradient
    is NaN (d sqrt(u)/du at u = 0 is inf, times du/dlogits = 0)."""
    loss = F.cross_entropy(logits.float(), targets.clamp(min=0))
    if bool((targets < 0).any()):
        loss = loss + torch.sqrt((logits * 0).sum())
    return loss


def _marked_task(marked: slice) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(96, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    y[marked] = -1
    return Task(
        build_model=DigitsCNN,
        train_data=TensorDataset(x, y),
        eval_data=TensorDataset(x[:16], y[:16].clamp(min=0)),
        loss_fn=_loss_nan_gradient_on_marked_samples,
        classification=True,
    )


def test_nonfinite_gradient_with_finite_loss_on_one_rank_is_skipped_everywhere(tmp_path: Path) -> None:
    # samples 10 and 11 are step 2's share of rank 1 (4 ranks x 2 samples, no shuffle): its loss is
    # finite, so only the gradient consensus (after the synchronising backward) can catch it
    for strategy in ("ddp", "zero3"):
        run = tmp_path / strategy
        cfg = load_config(
            overrides=[*DIGITS, f"strategy.model={strategy}", "train.steps=4", f"logging.run_dir={run}"]
        )
        results = run_training(cfg, task=_marked_task(slice(10, 12)))
        for r in results:
            assert r.skipped_steps == [2], strategy
            assert [s for s, _ in r.losses] == [1, 3, 4], strategy
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        skipped = [r for r in records if "skipped" in r]
        assert skipped == [{"step": 2, "skipped": "non-finite loss or gradient", "skipped_steps": 1}]
        assert records[-1]["step"] == 4 and records[-1]["skipped_steps"] == 1


def _tiny_lm(*extra: str) -> list[str]:
    return [
        "backend.name=inmemory",
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_layers=1",
        "model.seq_len=64",
        "data.max_bytes=10000",
        "logging.run_dir=null",
        "logging.progress=false",
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        # 10,000 bytes / 64 = 156 windows, 149 of them for training
        (
            ["data.global_batch_size=256"],
            ["data.global_batch_size=256", "149 training samples", "data.max_bytes"],
        ),
        # 1% of 156 windows: 1 held-out sample for 4 ranks
        (
            ["data.eval_fraction=0.01"],
            ["data.eval_fraction=0.01", "1 samples", "4 ranks", "train.eval_every=0"],
        ),
    ],
)
def test_data_too_small_for_the_config_is_rejected_before_any_rank_starts(
    extra: list[str], needles: list[str]
) -> None:
    cfg = load_config(overrides=_tiny_lm(*extra))
    with pytest.raises(ConfigError) as info:  # raised in the caller's thread, not by a failed rank
        run_training(cfg)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    # evaluation off: the small held-out set is fine
    if "data.eval_fraction=0.01" in extra:
        run_training(load_config(overrides=_tiny_lm(*extra, "train.eval_every=0", "train.steps=1")))


def test_scheduler_state_that_json_would_change_is_refused_before_training(tmp_path: Path) -> None:
    # MultiStepLR keeps its milestones in a Counter with int keys: JSON would bring them back as
    # strings and a resumed run would never decay again; refused when the Trainer is built
    def factory(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.MultiStepLR:
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4])

    cfg = load_config(overrides=[*_tiny_lm("train.steps=2"), f"checkpoint.dir={tmp_path / 'ck'}"])
    with pytest.raises(RankFailedError) as info:
        run_training(cfg, scheduler_factory=factory)
    assert isinstance(info.value.__cause__, CheckpointError)
    assert "LR scheduler's state (MultiStepLR)" in str(info.value.__cause__)
    assert "JSON round trip" in str(info.value.__cause__)
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing saved
    # without checkpoints the same scheduler is fine
    no_ckpt = load_config(overrides=_tiny_lm("train.steps=2"))
    assert [s for s, _ in run_training(no_ckpt, scheduler_factory=factory)[0].losses] == [1, 2]
    check_json({"lrs": (0.1, 0.2), "n": {"a": 1}}, "state")  # tuples come back as lists: fine


def test_torch_scheduler_from_the_config_resumes_exactly(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    sets = _tiny_lm(
        "model.seq_len=32",
        "data.max_bytes=40000",
        "data.global_batch_size=8",
        "train.steps=8",
        "optimizer.schedule=torch",
        "optimizer.torch_scheduler=OneCycleLR",
        "optimizer.torch_scheduler_args={max_lr: 0.01, pct_start: 0.5}",
    )
    full = run_training(load_config(overrides=[*sets, f"checkpoint.dir={ck}", "checkpoint.every=4"]))[0]
    resumed = run_training(load_config(overrides=[*sets, f"checkpoint.resume={ck / 'step_00000004'}"]))[0]
    assert resumed.start_step == 4 and resumed.losses == full.losses[4:]
    assert full.losses[-1][1] < full.losses[0][1]
