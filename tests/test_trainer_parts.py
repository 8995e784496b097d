"""Trainer building blocks: the data feed, LR schedules, guards, metrics, profiler."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dtlab.config import load_config
from dtlab.data import TensorDataset, stdlib_lm_dataset
from dtlab.errors import ArgumentError
from dtlab.lr_schedule import build_scheduler, lr_factor
from dtlab.testing import run_world
from dtlab.trainers import EarlyStopping, MetricsCollector, NonFiniteError, NonFiniteGuard, Profiler
from dtlab.trainers.feed import DataFeed


def test_feed_shards_cover_the_global_batch_and_resume_mid_epoch() -> None:
    n, g = 50, 8
    data = TensorDataset(torch.arange(n), torch.arange(n))
    ranks = [DataFeed(data, g, 2, r, accumulation_steps=2, seed=3) for r in range(2)]
    single = DataFeed(data, g, 1, 0, seed=3)
    seen: list[int] = []
    for _ in range(14):  # crosses two epoch boundaries (6 steps per epoch)
        micro = [s.next_micro_batches() for s in ranks]
        assert all(len(m) == 2 and all(len(x) == 2 for x, _ in m) for m in micro)
        joined = sorted(int(i) for m in micro for x, _ in m for i in x)
        (whole,) = single.next_micro_batches()
        assert joined == sorted(whole[0].tolist())  # world-size invariant: the same samples per step
        seen += joined
    assert ranks[0].steps_per_epoch == 6
    assert len(set(seen[:48])) == 48  # an epoch never repeats a sample
    assert seen[:48] != seen[48:96]  # epochs are reshuffled
    state = ranks[0].state_dict()
    fresh = DataFeed(data, g, 2, 0, accumulation_steps=2, seed=3)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(5):
        a, b = fresh.next_micro_batches(), ranks[0].next_micro_batches()
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="not divisible"):
        DataFeed(data, 6, 4, 0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DataFeed(TensorDataset(torch.arange(4), torch.arange(4)), 8, 1, 0)


def test_stdlib_corpus_is_deterministic_bytes() -> None:
    a, b = stdlib_lm_dataset(20_000, 32), stdlib_lm_dataset(20_000, 32)
    assert torch.equal(a.inputs, b.inputs) and a.inputs.shape == (624, 32)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])
    assert int(a.inputs.max()) < 256


def test_lr_schedules() -> None:
    cfg = load_config(overrides=["optimizer.warmup_steps=4", "optimizer.min_lr_ratio=0.1"]).optimizer
    f = lr_factor(cfg, total_steps=24)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(14) == pytest.approx(0.55) and f(24) == pytest.approx(0.1)
    step = lr_factor(cfg.model_copy(update={"schedule": "step", "step_size": 5, "gamma": 0.5}), 24)
    assert [step(s) for s in (4, 8, 9, 14)] == [1.0, 1.0, 0.5, 0.25]
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = build_scheduler(opt, cfg, 24)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_torch_scheduler_by_name_from_the_config() -> None:
    def lrs(sched: torch.optim.lr_scheduler.LRScheduler, opt: torch.optim.Optimizer) -> list[float]:
        out = []
        for _ in range(24):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    sets = ["optimizer.schedule=torch", "optimizer.torch_scheduler=OneCycleLR"]
    cfg = load_config(overrides=[*sets, "optimizer.torch_scheduler_args.max_lr=0.05"]).optimizer
    p = torch.nn.Parameter(torch.zeros(1))
    opt, ref_opt = torch.optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([p], lr=0.1, momentum=0.9)
    got = lrs(build_scheduler(opt, cfg, total_steps=24), opt)  # total_steps defaults to the run's length
    want = lrs(torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.05, total_steps=24), ref_opt)
    assert got == want and max(got) == pytest.approx(0.05, rel=0.01)
    cos = load_config(overrides=["optimizer.schedule=torch", "optimizer.torch_scheduler=CosineAnnealingLR"])
    opt = torch.optim.SGD([p], lr=0.1)
    sched = build_scheduler(opt, cos.optimizer, total_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR) and sched.T_max == 10


def test_nonfinite_guard_and_early_stopping() -> None:
    g = NonFiniteGuard(max_in_row=3)
    for step, ok in enumerate([True, False, False, True, False, False]):
        g.update(ok, step)
    assert g.skipped == 4 and g.skipped_steps == [1, 2, 4, 5]
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps .*train.max_nonfinite_steps=3"):
        g.update(False, 6)
    e = EarlyStopping(patience=2, min_delta=0.1)
    assert [e.update(v) for v in (3.0, 2.5, 2.45, 2.5)] == [False, False, False, True]
    assert not EarlyStopping(patience=0).update(1.0)
    # taken before: max_in_row=-1 stopped at the first skip, patience='3' failed at the first evaluation
    for make, text in [
        (lambda: NonFiniteGuard(max_in_row=-1), r"NonFiniteGuard.max_in_row must be an int >= 1, got -1"),
        (lambda: EarlyStopping(patience="3"), r"EarlyStopping.patience must be an int >= 0, got '3'"),  # type: ignore[arg-type]
        (lambda: EarlyStopping(patience=2, min_delta=-0.1), r"EarlyStopping.min_delta must be a number >= 0"),
    ]:
        with pytest.raises(ArgumentError, match=text):
            make()


def test_metrics_never_write_nan(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsCollector(path) as m:
        m.log(
            {"step": 1, "loss": float("nan"), "lr": 0.1, "x": [1.0, float("inf")], "c": {"d": float("-inf")}}
        )
        m.log({"step": 2, "loss": torch.tensor(2.5), "ratio": None})
    lines = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics")) for line in path.open()
    ]
    assert lines[0] == {"step": 1, "lr": 0.1, "x": [1.0, None], "c": {}}
    assert lines[1] == {"step": 2, "loss": 2.5}


def _profile(backend) -> dict:  # type: ignore[no-untyped-def]
    prof = Profiler(backend.stats)
    with prof.phase("forward_backward"):
        x = torch.randn(256, 256)
        for _ in range(5):
            x = torch.tanh(x @ x)
        backend.all_reduce(x)
    return prof.summary()


def test_profiler_splits_compute_and_communication() -> None:
    s = run_world(2, _profile)[0]
    assert set(s["phases"]) == {"compute/forward_backward", "comm/all_reduce"}
    assert s["comm_bytes_sent"]["all_reduce"] == 256 * 256 * 4  # 2(P-1)/P * n with P = 2
    total = s["compute_seconds"] + s["comm_seconds"]
    assert math.isclose(total, s["wall_seconds"], rel_tol=1e-6)


def test_auto_backend_is_in_memory_without_a_launcher() -> None:
    from dtlab.trainers.launch import resolve_backend_name

    cfg = load_config()
    assert resolve_backend_name(cfg, env={}) == "inmemory"
    assert (
        resolve_backend_name(cfg, env={"PMI_RANK": "0", "PMI_SIZE": "2"}) == "auto"
    )  # init_backend picks mpi
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_backend_name(cfg, env=torchrun) == "auto"
    assert resolve_backend_name(load_config(overrides=["backend.name=mpi"]), env={}) == "mpi"


def test_a_launcher_backend_started_without_a_launcher_refuses_an_in_memory_world_size() -> None:
    from dtlab.errors import ConfigError
    from dtlab.trainers.launch import launcher_detected, run_training

    if launcher_detected():
        pytest.skip("this process was started by a launcher")
    for name in ("gloo", "mpi"):  # refused before any backend starts: not a world of 1 training alone
        cfg = load_config(overrides=[f"backend.name={name}", "backend.world_size=2", "logging.run_dir=null"])
        with pytest.raises(ConfigError) as info:
            run_training(cfg)
        msg = str(info.value)
        assert f"backend.world_size=2 sizes the in-memory world only; backend.name='{name}'" in msg
        assert "torchrun --nproc-per-node 2 -m dtlab train" in msg and "backend.name=auto" in msg


def test_an_in_memory_world_under_a_launcher_of_several_processes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dtlab.errors import ConfigError
    from dtlab.trainers.launch import run_training

    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    for var, value in {**torchrun, "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)
    cfg = load_config(overrides=["backend.name=inmemory", "logging.run_dir=null"])
    with pytest.raises(
        ConfigError, match=r"backend.name='inmemory' in a process torchrun started as rank 1 of 2"
    ) as info:
        run_training(cfg)  # refused before any rank thread starts: not two separate runs
    assert "backend.name=auto (or gloo, nccl)" in str(info.value)  # not mpi: torchrun starts no MPI ranks
    for var in (*torchrun, "MASTER_PORT"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ConfigError, match=r"in a process mpiexec started as rank 0 of 2.*auto \(or mpi\)"):
        run_training(cfg)


def test_stray_launcher_variables_do_not_refuse_an_explicit_in_memory_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """backend.name=inmemory with WORLD_SIZE alone in the environment (no launcher started this process)
    reaches the next check, as before the launcher check: not 'incomplete torchrun launch variables'."""
    from dtlab.errors import ConfigError
    from dtlab.trainers.launch import run_training

    for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    missing = "checkpoint.resume=/nonexistent/dtlab-ckpt"
    cfg = load_config(overrides=["backend.name=inmemory", "logging.run_dir=null", missing])
    with pytest.raises(ConfigError, match="does not exist"):  # check_paths, after the launcher check
        run_training(cfg)
