"""Preemption: SIGTERM/SIGINT during training stops every rank after the same step, writes a final
checkpoint and exits with a status that says so; resuming from it reaches the uninterrupted run's
losses. In-process (the handler, one rank asking) and ``python -m dtlab train`` under no launcher,
torchrun (gloo) and mpiexec (MPI), each signalled with SIGTERM mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dtlab.config import TrainConfig, load_config
from dtlab.testing import TINY_LM
from dtlab.trainers import Task, build_task, run_training
from dtlab.trainers.preemption import EXIT_STATUS, StopRequest, stop_on_signals

BIN = Path(sys.executable).parent
SETS = [
    "backend.world_size=2",
    *TINY_LM,
    "optimizer.schedule=constant",  # the lr does not depend on train.steps: N steps = the first N of M
    "optimizer.warmup_steps=2",
    "train.eval_every=0",
    "logging.log_every=1",
    "logging.progress=false",
]


def _cfg(*extra: str) -> TrainConfig:
    return load_config(overrides=["backend.name=inmemory", *SETS, "logging.run_dir=null", *extra])


def _wait_until(cond: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return True
        time.sleep(0.02)
    return False


def test_first_signal_sets_the_request_and_a_second_acts_at_once() -> None:
    runner = signal.getsignal(signal.SIGINT)  # a pytest-xdist worker ignores SIGINT: Python's own here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _first_sets_second_acts()
    finally:
        signal.signal(signal.SIGINT, runner)


def _first_sets_second_acts() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        stop = StopRequest()
        with stop_on_signals(stop):
            assert signal.getsignal(sig) is not before[sig]
            os.kill(os.getpid(), sig)
            assert _wait_until(stop.is_set, 10)
            assert stop.reason == sig.name and EXIT_STATUS[sig.name] == 128 + sig
            # the handlers in place before are back: a second signal acts as without dtlab, at once
            assert {s: signal.getsignal(s) for s in before} == before
            if sig == signal.SIGINT:
                with pytest.raises(KeyboardInterrupt):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
        assert {s: signal.getsignal(s) for s in before} == before


def _one_rank_asks(stop: StopRequest, at_call: int) -> Task:
    """The tiny LM task whose loss function, on rank 1 only, asks to stop at its ``at_call``-th call."""
    base = build_task(_cfg())
    calls = [0]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "dtlab-rank-1":
            calls[0] += 1
            if calls[0] == at_call:
                stop.request("SIGTERM")
        return base.loss_fn(logits, targets)

    return Task(base.build_model, base.train_data, base.eval_data, loss_fn, base.tokens_per_sample)


def test_one_rank_asking_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    stop = StopRequest()
    results = run_training(
        _cfg(f"checkpoint.dir={ck}", "train.steps=50"), task=_one_rank_asks(stop, 3), stop=stop
    )
    assert [(r.preempted_by, r.final_step) for r in results] == [("SIGTERM", 3)] * 2
    assert results[0].checkpoint == str(ck / "step_00000003")
    assert (ck / "latest").read_text().strip() == "step_00000003"
    resumed = run_training(_cfg(f"checkpoint.dir={ck}", "checkpoint.resume=true", "train.steps=5"))[0]
    reference = run_training(_cfg("train.steps=5"))[0]
    assert results[0].losses == reference.losses[:3] and resumed.losses == reference.losses[3:]
    assert resumed.preempted_by is None
    # without checkpoint.dir the run stops the same way, with no checkpoint
    stop = StopRequest()
    res = run_training(_cfg("train.steps=50"), task=_one_rank_asks(stop, 2), stop=stop)[0]
    assert (res.preempted_by, res.final_step, res.checkpoint) == ("SIGTERM", 2, None)


def _sigterm_mid_run(tmp: Path, launcher: str) -> tuple[int, str, int]:
    """Start ``dtlab train`` (1000 steps) under ``launcher``, SIGTERM it once 3 steps are logged;
    returns (exit status, stderr, the step it stopped after)."""
    run, ck = tmp / "run", tmp / "ck"
    # no loss.png on the way out (matplotlib, seconds; tests/test_run_logging.py checks the plot)
    sets = [*SETS, "train.steps=1000", f"logging.run_dir={run}", f"checkpoint.dir={ck}", "logging.plot=false"]
    train = ["-m", "dtlab", "train"]
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *train]
    elif launcher == "mpiexec":
        cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, *train]
        sets.append("backend.name=mpi")
    else:
        cmd = [sys.executable, *train]
        sets.append("backend.name=inmemory")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp / "err.txt", "w") as err:
        proc = subprocess.Popen(
            cmd + [a for s in sets for a in ("--set", s)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
        try:

            def logged() -> bool:
                path = run / "metrics.jsonl"
                return path.is_file() and path.read_text().count('"loss"') >= 3

            assert _wait_until(logged, 120), f"{launcher}: no 3 steps within 120 s"
            proc.send_signal(signal.SIGTERM)  # to the launcher (or the in-memory process), by PID
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
                proc.wait(timeout=30)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    stopped = [r for r in records if "preempted_by" in r]
    assert len(stopped) == 1 and stopped[0]["preempted_by"] == "SIGTERM", records[-3:]
    step = stopped[0]["step"]
    assert stopped[0]["checkpoint"] == str(ck / f"step_{step:08d}")
    assert (ck / "latest").read_text().strip() == f"step_{step:08d}"
    return status, (tmp / "err.txt").read_text(), step


def _resumes_to_the_uninterrupted_losses(ck: Path, step: int, exact: bool) -> None:
    resumed = run_training(_cfg(f"checkpoint.dir={ck}", "checkpoint.resume=true", f"train.steps={step + 2}"))
    reference = run_training(_cfg(f"train.steps={step + 2}"))[0].losses
    assert resumed[0].start_step == step
    if exact:
        assert resumed[0].losses == reference[step:]
    else:  # another engine wrote the checkpoint: the same sums in another order
        assert [s for s, _ in resumed[0].losses] == [s for s, _ in reference[step:]]
        for (_, got), (_, want) in zip(resumed[0].losses, reference[step:], strict=True):
            assert got == pytest.approx(want, rel=1e-5)


def test_sigterm_in_memory(tmp_path: Path) -> None:
    status, err, step = _sigterm_mid_run(tmp_path, "inmemory")
    assert status == 143, err[-2000:]
    assert f"dtlab: SIGTERM: every rank stops after step {step}" in err
    assert f"dtlab train: stopped by SIGTERM after step {step} of 1000; checkpoint " in err
    assert "exit status 143" in err
    _resumes_to_the_uninterrupted_losses(tmp_path / "ck", step, exact=True)


@pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="torchrun not installed")
def test_sigterm_under_torchrun(tmp_path: Path) -> None:
    status, err, step = _sigterm_mid_run(tmp_path, "torchrun")
    # torchrun forwards SIGTERM to its workers and exits with its own status (1, SignalException);
    # the workers stop cleanly: rank 0 says so
    assert status != 0
    assert f"dtlab train: stopped by SIGTERM after step {step} of 1000; checkpoint " in err, err[-2000:]
    _resumes_to_the_uninterrupted_losses(tmp_path / "ck", step, exact=False)


@pytest.mark.skipif(not (BIN / "mpiexec").exists(), reason="mpiexec not installed")
def test_sigterm_under_mpiexec(tmp_path: Path) -> None:
    status, err, step = _sigterm_mid_run(tmp_path, "mpiexec")
    assert status == 143, err[-2000:]  # MPICH's mpiexec forwards SIGTERM and returns the ranks' status
    assert f"dtlab train: stopped by SIGTERM after step {step} of 1000; checkpoint " in err
    _resumes_to_the_uninterrupted_losses(tmp_path / "ck", step, exact=False)
