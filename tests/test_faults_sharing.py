"""A checkpoint directory shared or broken under a run: two runs on one directory (the second refused
before any work, naming the first), stale locks taken over, another run's step named on resume, a
``latest`` that is a directory, and a disk that fills during a save (a tmpfs of 2 MiB mounted by the
test). Each case asserts that nothing committed was lost, and the message."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dtlab.checkpoint import read_checkpoint
from dtlab.checkpoint.files import list_step_dirs
from dtlab.cli import main
from dtlab.config import TrainConfig, load_config
from dtlab.errors import CheckpointError, RankFailedError
from dtlab.testing import TINY_LM
from dtlab.trainers import TrainResult, run_training

SETS = [
    "backend.world_size=2",
    *TINY_LM,
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.run_dir=null",
    "checkpoint.every=2",
]


def _cfg(ck: Path, steps: int, *extra: str) -> TrainConfig:
    return load_config(
        overrides=["backend.name=inmemory", *SETS, f"checkpoint.dir={ck}", f"train.steps={steps}", *extra]
    )


def _train(ck: Path, steps: int, *extra: str) -> TrainResult:
    return run_training(_cfg(ck, steps, *extra))[0]


def _cause(exc: BaseException) -> BaseException:
    return exc.__cause__ if isinstance(exc, RankFailedError) and exc.__cause__ else exc


def _all_verify(ck: Path) -> list[int]:
    """Every step directory's step, each read and verified (sizes and SHA-256)."""
    return [read_checkpoint(p).step for _, p in list_step_dirs(ck)]


def _lock(ck: Path, **fields: Any) -> None:
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": "f" * 32, "started": time.time()}
    doc.update(fields)
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "lock").write_text(json.dumps(doc))


def test_two_runs_on_one_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run A (a ``dtlab train`` process) holds the directory; run B, started meanwhile with another
    seed, is refused before any work naming A; A's checkpoints are all there and verify. Then a resume
    with B's seed is told the step is another run's, and ``strict_resume`` refuses it."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "dtlab", "train", "--quiet"]
    cmd += [f"--set={s}" for s in [*SETS, f"checkpoint.dir={ck}", "train.steps=40", "checkpoint.keep_last=3"]]
    a = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (ck / "lock").exists() and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (ck / "lock").exists(), "run A did not take the lock"
        owner = json.loads((ck / "lock").read_text())
        assert owner["pid"] == a.pid and owner["host"] == socket.gethostname() and owner["run_id"]
        # run B: the same directory, another seed; refused with exit 2 before any step, naming A
        b = ["train", "--quiet", *(f"--set={s}" for s in SETS), f"--set=checkpoint.dir={ck}"]
        assert main([*b, "--set=train.steps=40", "--set=train.seed=1"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by run {owner['run_id'][:12]} (pid {a.pid} on host {socket.gethostname()}" in err
        assert "refused before any work" in err
        _, a_err = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(timeout=30)
    assert a.returncode == 0, a_err
    assert not (ck / "lock").exists()  # released at A's end
    assert _all_verify(ck) == [36, 38, 40]  # keep_last=3: A's last three, none of B's, all intact
    assert read_checkpoint(ck).step == 40 and not [
        p for p in ck.iterdir() if p.name.startswith((".tmp-", "sup"))
    ]
    runs = {read_checkpoint(p).meta["run"]["id"] for _, p in list_step_dirs(ck)}
    assert len(runs) == 1

    # another seed resuming A's step: said, and refused under strict_resume
    res = _train(ck, 42, "checkpoint.resume=true", "train.seed=1")
    assert res.resumed_from == str(ck / "step_00000040")
    assert any("train.seed=0, this run's is 1" in n for n in res.resume_notes), res.resume_notes
    # A's command again (seed 0): the newest step is now the seed-1 run's; strict_resume refuses it
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(ck, 44, "checkpoint.resume=true", "checkpoint.strict_resume=true")
    msg = str(_cause(info.value))
    assert "step_00000042 was written by a run with train.seed=1, this run's is 0" in msg
    assert "strict_resume=true refuses another run's checkpoint" in msg
    assert not (ck / "lock").exists()  # a refused run leaves no lock behind


def test_stale_and_live_locks(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = _train(ck, 4)
    assert first.checkpoint == str(ck / "step_00000004")
    # a live lock of this host (this very process, another run id): refused, nothing written
    _lock(ck, started=time.time() - 5)
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(ck, 6, "checkpoint.resume=true")
    assert f"is in use by run ffffffffffff (pid {os.getpid()} on host" in str(_cause(info.value))
    assert json.loads((ck / "lock").read_text())["run_id"] == "f" * 32  # the owner's lock is untouched
    assert _all_verify(ck) == [2, 4]
    # another host's lock, refreshed recently: refused; not refreshed for lock_stale_after: taken over
    _lock(ck, host="elsewhere", pid=1)
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(ck, 6, "checkpoint.resume=true", "checkpoint.lock_stale_after=60")
    assert "(pid 1 on host elsewhere" in str(_cause(info.value))
    old = time.time() - 120
    os.utime(ck / "lock", (old, old))
    res = _train(ck, 6, "checkpoint.resume=true", "checkpoint.lock_stale_after=60")
    assert res.resumed_from == str(ck / "step_00000004") and res.final_step == 6
    assert any(
        "took over the lock of run ffffffffffff" in n and "not refreshed for" in n for n in res.resume_notes
    )
    # a dead process of this host: taken over; the step to resume is not that run's, which is said
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    _lock(ck, pid=dead.pid)
    res = _train(ck, 8, "checkpoint.resume=true")
    notes = " | ".join(res.resume_notes)
    assert "took over the lock of run ffffffffffff" in notes and "its process is gone" in notes
    assert "not by run ffffffffffff" in notes and res.final_step == 8
    _lock(ck, pid=dead.pid)
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(ck, 10, "checkpoint.resume=true", "checkpoint.strict_resume=true")
    assert "refuses another run's checkpoint" in str(_cause(info.value))
    assert _all_verify(ck) == [6, 8] and not (ck / "lock").exists()


def test_latest_as_a_directory_is_handled_at_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _train(ck, 4, "checkpoint.keep_last=5")
    (ck / "latest").unlink()
    (ck / "latest").mkdir()
    (ck / "latest" / "something").write_text("kept")
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(ck, 6, "checkpoint.resume=true", "checkpoint.strict_resume=true")
    assert f"{ck / 'latest'} is a directory" in str(_cause(info.value))
    res = _train(ck, 6, "checkpoint.resume=true", "checkpoint.keep_last=5")
    assert res.resumed_from == str(ck / "step_00000004") and res.final_step == 6
    notes = " | ".join(res.resume_notes)
    assert f"{ck / 'latest'} is a directory" in notes and "moved to superseded-latest-" in notes
    aside = [p for p in ck.iterdir() if p.name.startswith("superseded-latest-")]
    assert len(aside) == 1 and (aside[0] / "something").read_text() == "kept"
    assert (ck / "latest").read_text().strip() == "step_00000006" and _all_verify(ck) == [2, 4, 6]
    # a fresh run (no resume) on a directory whose latest is a directory: handled before its first save
    (ck / "latest").unlink()
    (ck / "latest").mkdir()
    fresh = _train(ck, 2)
    assert fresh.checkpoint == str(ck / "step_00000002") and (ck / "latest").is_file()


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 2 MiB tmpfs mounted here (root only; skipped with the reason otherwise)."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_disk_full_during_a_save(small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """About four 0.4 MiB checkpoints fit in 2 MiB: the save that does not fit is a CheckpointError
    naming the path, the step, the space and the newest complete checkpoint; exit 2; every step
    saved before verifies, and the failed save's temporary files are gone."""
    ck = small_disk / "ck"
    args = ["train", "--quiet", *(f"--set={s}" for s in SETS), f"--set=checkpoint.dir={ck}"]
    assert (
        main([*args, "--set=train.steps=20", "--set=checkpoint.every=1", "--set=checkpoint.keep_last=20"])
        == 2
    )
    err = capsys.readouterr().err
    steps = _all_verify(ck)
    assert steps and steps == list(range(1, len(steps) + 1)) and len(steps) < 20, steps
    failed = len(steps) + 1
    assert f"checkpoint step {failed} was not saved: " in err and "No space left on device" in err, err
    assert "MiB were free" in err and "need" in err, err
    assert f"the newest complete one is {ck / f'step_{steps[-1]:08d}'}" in err, err
    assert (ck / "latest").read_text().strip() == f"step_{steps[-1]:08d}"
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".tmp-")] and not (ck / "lock").exists()
