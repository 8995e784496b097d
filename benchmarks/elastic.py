"""Measure elastic training under torchrun: two agents on this machine train with
``dtlab train --set elastic.commit_every=N``; one is killed with its worker and its node-local commit
directory, the other restarts alone and resumes from the last commit, then the killed one is started
again and the job grows back to two. Prints a markdown table and writes the raw timeline as JSON.

    .venv/bin/python benchmarks/elastic.py                          # the figures in docs/elastic.md
    .venv/bin/python benchmarks/elastic.py --commit-every 20 --steps 300 --kill-after 50 --out runs/elastic

Times (wall clock, ``time.time()`` of this process and of the workers, one machine):

- *detect*: from the SIGKILL of agent b and its worker until the survivor's ``dtlab train`` returns
  with the error (gloo reports the closed connection at its next collective), and until its worker
  process has exited (the interpreter's teardown), which is what its agent waits for to restart it;
- *recover*: from the SIGKILL to the end of the restore in the new one-rank world (the survivor's
  agent waited for the dead agent's rendezvous heartbeat to expire, re-rendezvoused, started a fresh
  worker; the worker pooled the commits, loaded them and re-committed);
- *grow*: from starting agent b again to the end of the restore in the new two-rank world;
- *redone*: steps logged before the restore minus the restored step (at most ``commit_every``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dtlab.testing.torchrun_elastic import TorchrunJob, shrink_and_grow  # noqa: E402


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run = work / "run"
    nodes = {n: work / f"node-{n}" for n in ("a", "b")}
    sets = [
        f"elastic.commit_every={args.commit_every}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "logging.progress=false",
        "logging.log_every=1",
        f"logging.run_dir={run}",
        "backend.name=gloo",
        *args.set,
    ]
    # ``dtlab train`` itself (dtlab.cli.main), stamping the wall time at which it returns: for the
    # survivor, when its collective failed and it gave up (before the interpreter's own teardown)
    stamp = (
        "import sys, time; from dtlab.cli import main; rc = main(sys.argv[1:]); "
        "print(f'dtlab-returned {rc} {time.time():.3f}', file=sys.stderr, flush=True); sys.exit(rc)"
    )
    worker = ["-c", stamp, "train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    load0 = os.getloadavg()[0]
    keep_alive = (args.keep_alive_interval, args.keep_alive_attempts)
    with TorchrunJob(worker, work / "agents", keep_alive=keep_alive) as job:
        out = shrink_and_grow(
            job,
            run / "metrics.jsonl",
            {n: ["--set", f"elastic.dir={d}"] for n, d in nodes.items()},
            lost_disk=nodes["b"],
            kill_after=args.kill_after,
            timeout=args.timeout,
        )
        returned = [
            float(line.split()[2])
            for line in job.log("a").splitlines()
            if line.startswith("dtlab-returned ") and float(line.split()[2]) > out["t_kill"]
        ]
    shrink, grow = out["restores"]
    commits = [r["elastic_commit"] for r in out["records"] if "elastic_commit" in r]
    steps = [r for r in out["records"] if "loss" in r]
    return {
        "command": " ".join(["torchrun ...", "-m dtlab train", *[f"--set {s}" for s in sets]]),
        "keep_alive_s": args.keep_alive_interval * args.keep_alive_attempts,
        "load_average_1min": [load0, os.getloadavg()[0]],
        "error_s": min(returned) - out["t_kill"] if returned else None,
        "detect_s": out["t_detect"] - out["t_kill"],
        "recover_s": shrink["unix_time"] - out["t_kill"],
        "grow_s": grow["unix_time"] - out["t_restart_b"],
        "restore_s": [shrink["seconds"], grow["seconds"]],
        "restored_steps": [shrink["step"], grow["step"]],
        "redone": [
            b - r["step"] for b, r in zip(out["last_step_before_restore"], out["restores"], strict=True)
        ],
        "last_step_before_kill": out["last_step_before_kill"],
        "commit_s_median": sorted(c["seconds"] for c in commits)[len(commits) // 2] if commits else None,
        "commit_bytes": [c["bytes"] for c in commits[:1]],
        "held_bytes": [c["held_bytes"] for c in commits[:1]],
        "step_time_s_median": sorted(r["step_time_s"] for r in steps)[len(steps) // 2] if steps else None,
        "exit_codes": out["exit_codes"],
        "final_step": max(r["step"] for r in steps),
        "timeline": {k: v for k, v in out.items() if k != "records"},
    }


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def table(res: dict[str, Any]) -> str:
    rows = [
        ("time to detect (kill -> the survivor's collective fails, dtlab train returns)", _s(res["error_s"])),
        ("  the survivor's worker process has exited", f"{res['detect_s']:.2f} s"),
        ("time to recover (kill -> restored on 1 rank)", f"{res['recover_s']:.2f} s"),
        ("  of which the restore itself", f"{res['restore_s'][0]:.2f} s"),
        ("steps redone after the kill", f"{res['redone'][0]} (restored step {res['restored_steps'][0]})"),
        ("time to grow (agent started -> restored on 2 ranks)", f"{res['grow_s']:.2f} s"),
        ("steps redone when growing", f"{res['redone'][1]} (restored step {res['restored_steps'][1]})"),
        ("commit (median), one rank's commit", f"{res['commit_s_median']:.3f} s, {res['commit_bytes']} B"),
        ("step time (median)", f"{res['step_time_s_median']:.3f} s"),
        ("rendezvous keep-alive timeout", f"{res['keep_alive_s']} s"),
        ("load average (1 min) before / after", " / ".join(f"{x:.1f}" for x in res["load_average_1min"])),
    ]
    lines = ["| measured | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit-every", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-after", type=int, default=50, help="kill agent b once this step is logged")
    p.add_argument("--keep-alive-interval", type=int, default=1)
    p.add_argument("--keep-alive-attempts", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each wait may take")
    p.add_argument("--set", action="append", default=[], help="extra dtlab train override (repeatable)")
    p.add_argument("--out", default=None, help="directory for elastic.json (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtlab-elastic-") as tmp:
        res = measure(args, Path(tmp))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "elastic.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    ok = res["exit_codes"] == {"a": 0, "b": 0} and res["final_step"] == args.steps
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
