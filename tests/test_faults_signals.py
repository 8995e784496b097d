"""Signals that repeat: ``dtlab train`` given SIGINT twice (as a terminal or ``timeout`` may deliver it to
a process group) stops every rank with a final checkpoint, or, on a later signal while it stops, exits
at once with 130; never an abort, and every committed checkpoint verifies. ``dtlab bench`` given
SIGTERM ends its benchmark's whole process tree and writes its report. ``dtlab train``'s exit skips the
interpreter's final full garbage collection over what importing torch made (the seconds a torchrun
restart waits for a worker to exit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtlab.checkpoint import read_checkpoint
from dtlab.checkpoint.files import list_step_dirs
from dtlab.testing import TINY_LM
from dtlab.trainers.preemption import StopRequest, stop_on_signals

SETS = [
    "backend.world_size=2",
    *TINY_LM,
    "optimizer.warmup_steps=0",
    "train.eval_every=0",
    "train.steps=100000",
    "logging.run_dir=null",
    "checkpoint.every=3",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_signal_delivered_twice_at_once_is_one_request() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest()
    with stop_on_signals(stop, exit_on_repeat=True):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # within same_within: the same request, no exit
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.reason == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]  # still ours
    assert {s: signal.getsignal(s) for s in before} == before


#: a model whose training forward takes 4 s: a signal 1 s after a step began finds that step running
SLOW_MODULE = """
import time
import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if self.training:
            time.sleep(4.0)
        return self.lin(x)


def model():
    return Slow()


def data():
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
"""


def _start(ck: Path, *extra: str, path: str = "") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "dtlab", "train", "--quiet", *(f"--set={s}" for s in [*SETS, *extra])]
    cmd.append(f"--set=checkpoint.dir={ck}")
    env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (path, ENV.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"{path} did not appear"


def _committed_intact(ck: Path) -> int:
    """Every step directory verifies; returns the step ``latest`` names (which verifies too)."""
    for _, p in list_step_dirs(ck):
        read_checkpoint(p)
    return read_checkpoint(ck).step


def test_two_sigints_in_a_row(tmp_path: Path) -> None:
    """Two runs side by side: (a) two SIGINTs at once to the process group: one stop, the final
    checkpoint, 130; (b) a SIGINT as a 4-second step begins and another 1 s later, while that step
    still runs: exit 130 at once, the checkpoints committed before intact, the lock released."""
    a_ck, b_ck = tmp_path / "a", tmp_path / "b"
    (tmp_path / "dtlab_slow_mod.py").write_text(SLOW_MODULE)
    a = _start(a_ck)
    slow = [
        "model.factory=dtlab_slow_mod:model",
        "data.factory=dtlab_slow_mod:data",
        "data.global_batch_size=8",
    ]
    b = _start(b_ck, *slow, "checkpoint.every=1", path=str(tmp_path))
    try:
        _wait_for(a_ck / "latest", a, 180)
        os.killpg(a.pid, signal.SIGINT)
        os.killpg(a.pid, signal.SIGINT)
        _wait_for(b_ck / "step_00000002", b, 180)  # step 2 saved: its stop check, then step 3 (4 s)
        time.sleep(0.5)
        os.killpg(b.pid, signal.SIGINT)
        time.sleep(1.0)
        os.killpg(b.pid, signal.SIGINT)
        t_b = time.monotonic()
        _, b_err = b.communicate(timeout=120)
        b_took = time.monotonic() - t_b
        _, a_err = a.communicate(timeout=120)
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    for err in (a_err, b_err):
        assert "terminate called" not in err and "Traceback" not in err, err
    # (a): the same request twice -> the agreed stop with its final checkpoint
    assert a.returncode == 130, a_err
    assert "dtlab train: stopped by SIGINT after step" in a_err and "exit status 130" in a_err, a_err
    final = int(a_err.split("stopped by SIGINT after step ")[1].split()[0])
    assert _committed_intact(a_ck) == final and not (a_ck / "lock").exists()
    # (b): a later signal while stopping -> exit at once, nothing committed lost
    assert b.returncode == 130, b_err
    assert "dtlab: SIGINT again while stopping (SIGINT): exiting now with status 130" in b_err, b_err
    assert "every checkpoint committed before is intact" in b_err and b_took < 3.5, (b_took, b_err)
    assert _committed_intact(b_ck) == 2 and not (b_ck / "lock").exists()


# dtlab train as ``python -m dtlab`` runs it (argv from sys.argv), reporting at exit, just before the
# interpreter's final collection, how many objects that collection walks and how many it skips
EXIT_PROBE = """
import atexit, gc, sys
walks = lambda: len(gc.get_objects())
atexit.register(lambda: print("final gc walks", walks(), "skips", gc.get_freeze_count(), file=sys.stderr))
from dtlab.cli import main
sys.argv = ["dtlab", "train", "--quiet", *sys.argv[1:]]
sys.exit(main())
"""


def test_train_exits_without_a_full_collection_of_torch() -> None:
    """The last full garbage collection of a process that imported torch walks ~300,000 objects (1-2
    CPU-seconds, every worker restart under torchrun waits for it): ``dtlab train`` freezes them once
    its work is done, so that collection walks only what was made after (counts, not seconds)."""
    sets = ["backend.world_size=1", *TINY_LM, "train.steps=2", "train.eval_every=0", "logging.run_dir=null"]
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE, *(f"--set={s}" for s in sets)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("final gc walks"))
    walks, skips = int(line.split()[3]), int(line.split()[5])
    assert skips > 50_000 and walks < skips // 100, line


def _group(pgid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # alive (a zombie is already dead)
                found.append(int(d.name))
    return found


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def test_a_signalled_bench_ends_its_process_tree_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    bench = subprocess.Popen(
        [sys.executable, "-m", "dtlab", "bench", "--only", "strategies", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        child: int | None = None
        while time.monotonic() < deadline and child is None and bench.poll() is None:
            kids = _children(bench.pid)
            child = kids[0] if kids else None
            time.sleep(0.05)
        assert child is not None, "dtlab bench started no benchmark"
        deadline = time.monotonic() + 60  # let the benchmark start its ranks
        while time.monotonic() < deadline and len(_group(child)) < 2:
            time.sleep(0.1)
        tree = _group(child)  # the benchmark in its own process group, with what it started
        bench.send_signal(signal.SIGTERM)  # as timeout(1) does: to dtlab bench only
        t0 = time.monotonic()
        _, stderr = bench.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(timeout=30)
    assert bench.returncode == 143, stderr
    assert took < 20, took
    assert tree and not _group(child), (tree, _group(child))
    report = (out / "bench.md").read_text()
    assert "## strategies" in report and "STOPPED by SIGTERM" in report, report
    assert "stopped by SIGTERM; its processes were ended" in stderr
    assert (
        "stopped by SIGTERM: the benchmark and its processes were ended"
        in (out / "strategies.log").read_text()
    )
