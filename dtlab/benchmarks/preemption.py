"""How fast ``dtlab train`` stops on SIGTERM: print a markdown table.

    .venv/bin/python -m dtlab.benchmarks.preemption                                # default model, 4 ranks
    .venv/bin/python -m dtlab.benchmarks.preemption --launcher torchrun --ranks 2  # gloo
    .venv/bin/python -m dtlab.benchmarks.preemption --launcher mpiexec --ranks 2   # MPI

Each trial starts ``python -m dtlab train`` (``checkpoint.dir`` set, metrics every step), waits until
``--after`` steps are logged, sends SIGTERM to the process it started (the launcher under torchrun and
mpiexec, which forward it to the ranks), and measures: seconds from the signal to rank 0's line
``dtlab train: stopped by SIGTERM ...`` (checkpoint written, summary printed) and to the exit of the
process (Python and torch teardown included), the steps trained after the signal (the ranks finish
the step they are in and agree at its end), the seconds the final checkpoint took (the
``checkpoint_s`` of the ``preempted_by`` record in ``metrics.jsonl``), its size and the exit status.
``--set`` passes overrides to ``dtlab train`` (e.g. ``--set model.d_model=256``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _cmd(launcher: str, ranks: int, sets: list[str]) -> list[str]:
    bin_dir = Path(sys.executable).parent
    train = ["-m", "dtlab", "train"]
    if launcher == "torchrun":
        cmd = [str(bin_dir / "torchrun"), "--nproc-per-node", str(ranks), *train]
    elif launcher == "mpiexec":
        cmd = [str(bin_dir / "mpiexec"), "-n", str(ranks), sys.executable, *train]
        sets = [*sets, "backend.name=mpi"]
    else:
        cmd = [sys.executable, *train]
        sets = [*sets, "backend.name=inmemory", f"backend.world_size={ranks}"]
    return cmd + [a for s in sets for a in ("--set", s)]


def _logged_steps(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def trial(launcher: str, ranks: int, after: int, extra: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run, ck = Path(tmp) / "run", Path(tmp) / "ck"
        sets = ["train.steps=100000", "train.eval_every=0", "logging.log_every=1", "logging.progress=false"]
        sets += [f"logging.run_dir={run}", f"checkpoint.dir={ck}", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            _cmd(launcher, ranks, sets),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        lines: list[tuple[float, str]] = []

        stderr = proc.stderr  # a pipe: the Popen above passes stderr=subprocess.PIPE
        if stderr is None:
            raise RuntimeError("the training process was started without a stderr pipe")

        def read() -> None:
            for line in stderr:
                lines.append((time.perf_counter(), line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + timeout
            while _logged_steps(run / "metrics.jsonl") < after:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{launcher}: {after} steps not logged within {timeout:g} s")
                time.sleep(0.01)
            logged = _logged_steps(run / "metrics.jsonl")
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=timeout)
            exit_s = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        reader.join(timeout=30)
        said = [t for t, line in lines if "dtlab train: stopped by SIGTERM" in line]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        stopped = next(r for r in records if "preempted_by" in r)
        return {
            "stopped_line_s": said[0] - t0 if said else float("nan"),
            "exit_s": exit_s,
            "steps_after_signal": stopped["step"] - logged,
            "checkpoint_s": stopped.get("checkpoint_s", 0.0),
            "checkpoint_mb": sum(f.stat().st_size for f in Path(stopped["checkpoint"]).iterdir()) / 2**20,
            "status": status,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launcher", choices=["inmemory", "torchrun", "mpiexec"], default="inmemory")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--after", type=int, default=10, help="steps logged before the signal")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    rows = [trial(args.launcher, args.ranks, args.after, args.sets, args.timeout) for _ in range(args.trials)]
    print(f"| {args.launcher} x {args.ranks} | median | min | max |")
    print("|---|---|---|---|")
    for key in ("stopped_line_s", "exit_s", "checkpoint_s", "steps_after_signal", "checkpoint_mb"):
        vals = [float(r[key]) for r in rows]
        print(f"| {key} | {statistics.median(vals):.3g} | {min(vals):.3g} | {max(vals):.3g} |")
    print(f"| exit status | {', '.join(str(r['status']) for r in rows)} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
