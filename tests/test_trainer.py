"""The Trainer end to end on real strategies (in-memory ranks): the CLI default (shortened), exact
resume, resharding 4 -> 2 ranks and DDP -> FSDP, accumulation, the NaN guard, early stopping."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.config import TrainConfig, load_config
from dtlab.data import TensorDataset
from dtlab.errors import RankFailedError
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import NonFiniteError, Task, Trainer, run_training
from dtlab.trainers.models import DigitsCNN
from dtlab.trainers.tasks import build_task

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "optimizer.warmup_steps=2",
    "train.eval_every=0",
    "strategy.persistence_threshold=0",
    "logging.progress=false",
]


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    return load_config(overrides=[*TINY, f"logging.run_dir={tmp / 'run'}", *extra])


def _no_nan(line: str) -> dict[str, Any]:
    def bad(c: str) -> None:
        raise AssertionError(f"{c} in metrics line {line!r}")

    return json.loads(line, parse_constant=bad)


def test_cli_default_shortened_trains_and_writes_clean_metrics(tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    sets = ["train.steps=30", "data.max_bytes=100000", "model.d_model=48", "train.eval_every=15"]
    sets += ["logging.log_every=10", f"logging.run_dir={run}"]
    code = main(["train", *[a for s in sets for a in ("--set", s)]])
    assert code == 0
    out = capsys.readouterr()
    assert "dtlab train: summary" in out.out and "where step time goes" in out.out
    assert "progress 30/30 (100%)" in out.err and "step    10 | loss" in out.err  # progress and metrics
    assert "\x1b" not in out.err + out.out  # captured output is no terminal: plain lines
    records = [_no_nan(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [10, 20, 30]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, steps  # the loss clearly falls
    first = steps[0]
    assert len(first["bytes_sent_per_rank"]) == 4 and min(first["bytes_sent_per_rank"]) > 0
    assert len(first["memory_per_rank"]) == 4 and first["memory_per_rank"][0]["parameters"] > 0
    for key in ("lr", "tokens_per_s", "samples_per_s", "compute_s", "comm_s", "step_time_s"):
        assert first[key] > 0, key
    assert [r["step"] for r in records if "eval_loss" in r] == [15, 30]
    profile = json.loads((run / "profile.json").read_text())
    assert profile["profile"]["comm_seconds"] > 0


def test_resume_continues_exactly(tmp_path: Path) -> None:
    # TopkA with error feedback: its residuals are part of the checkpoint (every compressor, with and
    # without warm-up: tests/test_compression_resume.py)
    topka = ["compression.algorithm=topka", "compression.density=0.1", "compression.dense_warmup_steps=0"]
    for name, extra in (("ddp", []), ("fsdp", []), ("zero2-topka", topka)):
        ck = tmp_path / name
        strategy = name.split("-")[0]
        common = [f"strategy.model={strategy}", "train.steps=8", "data.accumulation_steps=2", *extra]
        full = run_training(
            _cfg(tmp_path, *common, f"checkpoint.dir={ck}", "checkpoint.every=4", "checkpoint.keep_last=3")
        )
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000004", "step_00000008"]
        resumed = run_training(
            _cfg(
                tmp_path,
                *common,
                f"checkpoint.dir={tmp_path / name / 'again'}",
                f"checkpoint.resume={ck / 'step_00000004'}",
            )
        )
        assert resumed[0].start_step == 4
        assert resumed[0].losses == full[0].losses[4:], name  # bitwise the same sequence
        a = load_file(str(ck / "step_00000008" / "model_rank00000.safetensors"))
        b = load_file(str(tmp_path / name / "again" / "step_00000008" / "model_rank00000.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _load_full(backend: CommunicationBackend, config: TrainConfig) -> tuple[dict[str, torch.Tensor], list]:
    trainer = Trainer(config, backend)
    state = trainer.model.full_state_dict()
    return state, trainer.fit().losses


def test_reshard_4_ranks_ddp_to_2_ranks_fsdp(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    base = ["optimizer.name=adamw", "train.steps=6"]
    # 6 uninterrupted steps on 4 ranks under DDP, saving at step 3 and 6
    reference = run_training(_cfg(tmp_path, *base, f"checkpoint.dir={ck}", "checkpoint.every=3"))[0].losses
    step3 = f"checkpoint.resume={ck / 'step_00000003'}"
    saved_full = run_world(4, _load_full, _cfg(tmp_path, *base, "train.steps=3", step3))[0][0]
    for strategy in ("fsdp", "zero2"):
        cfg = _cfg(tmp_path, *base, "backend.world_size=2", f"strategy.model={strategy}", step3)
        state, losses = run_world(2, _load_full, cfg)[0]
        assert state.keys() == saved_full.keys()
        for k in state:
            assert torch.equal(state[k], saved_full[k]), (strategy, k)  # identical full parameters
        # the optimizer state came along too: the continuation matches the uninterrupted 4-rank run
        assert [s for s, _ in losses] == [4, 5, 6]
        for (_, got), (_, want) in zip(losses, reference[3:], strict=True):
            assert got == pytest.approx(want, rel=1e-4), strategy
    out = tmp_path / "full.safetensors"
    assert main(["consolidate", str(ck / "step_00000003"), "-o", str(out)]) == 0
    merged = load_file(str(out))
    assert merged.keys() == saved_full.keys()
    assert all(torch.equal(merged[k], saved_full[k]) for k in saved_full)


def _bytes_and_losses(tmp: Path, accum: int) -> tuple[int, list[tuple[int, float]]]:
    cfg = _cfg(
        tmp,
        "train.steps=3",
        f"data.accumulation_steps={accum}",
        "logging.log_every=3",
        f"logging.run_dir={tmp / f'acc{accum}'}",
    )
    res = run_training(cfg)[0]
    rec = [_no_nan(x) for x in (tmp / f"acc{accum}" / "metrics.jsonl").read_text().splitlines()]
    return rec[-1]["bytes_sent_per_rank"][0], res.losses


def test_accumulation_communicates_only_on_the_last_micro_step(tmp_path: Path) -> None:
    b1, l1 = _bytes_and_losses(tmp_path, 1)
    b2, l2 = _bytes_and_losses(tmp_path, 2)
    assert b1 == b2  # no_sync: the same gradient traffic with 2 micro-steps as with one
    for (s1, x1), (s2, x2) in zip(l1, l2, strict=True):
        assert s1 == s2 and x1 == pytest.approx(x2, rel=1e-5)


def _digits_task(nan_from: int, nan_to: int) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(96, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    x[nan_from:nan_to] = float("nan")
    return Task(
        build_model=DigitsCNN,
        train_data=TensorDataset(x, y),
        eval_data=TensorDataset(x[:16].nan_to_num(), y[:16]),
        classification=True,
    )


DIGITS = [
    "backend.name=inmemory",
    "model.name=digits_cnn",
    "data.dataset=digits",
    "data.global_batch_size=8",
    "data.shuffle=false",
    "logging.progress=false",
    "logging.run_dir=null",
    "train.eval_every=0",
]


def test_nonfinite_loss_on_one_rank_skips_the_step_everywhere() -> None:
    # samples 10 and 11 (step 2, rank 1 of 4) are NaN: every rank skips step 2 and carries on
    for extra in (
        ["strategy.model=ddp"],
        ["strategy.model=fsdp"],
        ["compression.algorithm=oktopk", "compression.density=0.2", "compression.dense_warmup_steps=0"],
    ):
        cfg = load_config(overrides=[*DIGITS, "train.steps=5", *extra])
        results = run_training(cfg, task=_digits_task(10, 12))
        for r in results:
            assert r.skipped_steps == [2], extra
            assert [s for s, _ in r.losses] == [1, 3, 4, 5]
            assert all(math.isfinite(v) for _, v in r.losses)
    cfg = load_config(overrides=[*DIGITS, "train.steps=8", "train.max_nonfinite_steps=3"])
    with pytest.raises(RankFailedError) as info:
        run_training(cfg, task=_digits_task(24, 96))  # every step from step 4 on is NaN
    assert isinstance(info.value.__cause__, NonFiniteError)
    assert "3 consecutive steps (up to step 6)" in str(info.value.__cause__)


def test_early_stopping_is_agreed_and_bf16_and_compression_metrics(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "train.steps=20",
        "train.eval_every=2",
        "train.early_stopping_patience=1",
        "train.early_stopping_min_delta=100",
        "train.precision=bf16",
        "strategy.model=zero3",
    )
    results = run_training(cfg)
    assert all(r.stopped_early and r.final_step == 4 for r in results)
    assert all(math.isfinite(v) for _, v in results[0].losses)
    cfg = _cfg(
        tmp_path,
        "train.steps=4",
        "logging.log_every=2",
        "compression.algorithm=oktopk",
        "compression.density=0.1",
        "compression.dense_warmup_steps=1",
        "compression.ramp_steps=2",  # steps 2-3 at 25%, then 10%
        f"logging.run_dir={tmp_path / 'c'}",
    )
    run_training(cfg)
    recs = [_no_nan(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert recs and all("compression" in r for r in recs)
    assert recs[0]["compression"]["local_density"] > recs[-1]["compression"]["local_density"], recs
    assert 0 < recs[-1]["compression"]["density"] <= 0.5, recs[-1]
    assert recs[-1]["compression"]["compression_ratio"] > 1, recs[-1]  # fewer bytes than dense


def test_any_torch_lr_scheduler_and_its_state_is_checkpointed(tmp_path: Path) -> None:
    def factory(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    ck = tmp_path / "ck"
    cfg = _cfg(tmp_path, "train.steps=4", "logging.log_every=1", "optimizer.lr=0.01", f"checkpoint.dir={ck}")
    run_training(cfg, scheduler_factory=factory)
    lrs = [r["lr"] for r in map(_no_nan, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert lrs == pytest.approx([0.01, 0.005, 0.005, 0.0025])  # the lr after each step
    resumed = _cfg(tmp_path, "train.steps=6", "logging.log_every=1", "optimizer.lr=0.01",
                   f"checkpoint.resume={ck}")  # fmt: skip
    run_training(resumed, scheduler_factory=factory)
    records = list(map(_no_nan, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
    own = records[4]  # the resume's own record; it saves nowhere (checkpoint.dir unset) and says so
    assert own.pop("resume_notes")[0].startswith("checkpoint.dir is unset: this run saves no checkpoint"), own
    assert own == {"step": 4, "resumed_from": str(ck / "step_00000004")}
    assert [r["lr"] for r in records if "lr" in r][4:] == pytest.approx([0.0025, 0.00125])


def test_clipping_uses_the_global_norm_under_every_strategy(tmp_path: Path) -> None:
    norms = {}
    for strategy in ("ddp", "zero2", "zero3", "fsdp"):
        run = tmp_path / strategy
        cfg = _cfg(tmp_path, f"strategy.model={strategy}", "train.steps=3", "logging.log_every=1",
                   "optimizer.clip_grad_norm=0.5", f"logging.run_dir={run}")  # fmt: skip
        run_training(cfg)
        norms[strategy] = [_no_nan(x)["grad_norm"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert norms["ddp"][0] > 0.5  # clipping is active
    for strategy in ("zero2", "zero3", "fsdp"):  # sharded gradients: the same global norm as DDP
        assert norms[strategy] == pytest.approx(norms["ddp"], rel=1e-4), strategy


def test_zero1_gradient_sync_from_the_config_trains_alike_with_fewer_bytes(tmp_path: Path) -> None:
    sent, losses = {}, {}
    for mode in ("reduce_scatter", "all_reduce"):
        run = tmp_path / mode
        cfg = _cfg(
            tmp_path,
            "strategy.model=zero1",
            f"strategy.gradient_sync={mode}",
            "train.steps=4",
            "logging.log_every=4",
            f"logging.run_dir={run}",
        )
        losses[mode] = run_training(cfg)[0].losses
        rec = [_no_nan(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        sent[mode] = rec[-1]["bytes_sent_per_rank"][0]
    for (s1, x1), (s2, x2) in zip(losses["reduce_scatter"], losses["all_reduce"], strict=True):
        assert s1 == s2 and x1 == pytest.approx(x2, rel=1e-5)
    # per step: reduce-scatter + all-gather = 2(P-1)/P of the gradient bytes, against all-reduce +
    # all-gather = 3(P-1)/P; the rest of the traffic (loss, guard) is the same in both runs
    task = build_task(_cfg(tmp_path))
    grad_bytes = 4 * sum(p.numel() for p in task.build_model().parameters())
    assert sent["all_reduce"] - sent["reduce_scatter"] == pytest.approx(4 * 3 / 4 * grad_bytes, rel=0.01)


def test_momentum_correction_from_the_config(tmp_path: Path) -> None:
    """``compression.momentum_correction=true``: the SGD runs without momentum and the reducer keeps
    the velocities; with ``dense`` that is plain momentum SGD (same losses up to rounding)."""
    sgd = ["optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.weight_decay=0",
           "optimizer.clip_grad_norm=null", "train.steps=5", "compression.dense_warmup_steps=0"]  # fmt: skip
    plain = run_training(_cfg(tmp_path, *sgd, "compression.algorithm=dense"))
    corrected = _cfg(tmp_path, *sgd, "compression.algorithm=dense", "compression.momentum_correction=true")
    moved = run_training(corrected)
    a, b = [v for _, v in plain[0].losses], [v for _, v in moved[0].losses]
    assert a == pytest.approx(b, rel=1e-5) and a[0] != a[-1]

    def build(backend: CommunicationBackend) -> tuple[float, float | None]:
        cfg = _cfg(tmp_path, *sgd, "compression.algorithm=topka", "compression.momentum_correction=true")
        trainer = Trainer(cfg, backend, build_task(cfg))
        opt = trainer.optimizer
        return opt.optimizer.param_groups[0]["momentum"], opt.reducer.error_feedback.momentum

    assert run_world(2, build) == [(0.0, 0.9), (0.0, 0.9)]
