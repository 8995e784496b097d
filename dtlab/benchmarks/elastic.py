"""Measure elastic training under torchrun: two agents on this machine train with
``dtlab train --set elastic.commit_every=N``; one is killed with its worker and its node-local commit
directory, the other restarts alone and resumes from the last commit, then the killed one is started
again and the job grows back to two. Prints a markdown table and writes the raw timeline as JSON.

    .venv/bin/python -m dtlab.benchmarks.elastic                          # the figures in docs/elastic.md
    .venv/bin/python -m dtlab.benchmarks.elastic --commit-every 20 --steps 300 --kill-after 50 \
        --out runs/elastic

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
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dtlab.testing.torchrun_elastic import TorchrunJob, shrink_and_grow

_STAMP = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")


def agent_events(log: str, what: str, after: float) -> list[float]:
    """``time.time()`` of the agent log lines containing ``what`` (torchrun stamps them with the local
    time of day), from ``after`` on."""
    day = datetime.datetime.fromtimestamp(after).replace(hour=0, minute=0, second=0, microsecond=0)
    out = []
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and what in line:
            h, mi, s = int(m.group(1)), int(m.group(2)), float(m.group(3))
            t = (day + datetime.timedelta(hours=h, minutes=mi, seconds=s)).timestamp()
            if t >= after:
                out.append(t)
    return out


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
    train = ["train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    worker = ["--no-python", sys.executable, "-c", stamp, *train]
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
        log_a, log_b = job.log("a"), job.log("b")
        rdzv_alone = agent_events(log_a, "Rendezvous complete", out["t_kill"])
        b_up = agent_events(log_b, "Rendezvous'ing worker group", out["t_restart_b"])
        rdzv_two = agent_events(log_b, "Rendezvous complete", out["t_restart_b"])
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
        "rendezvous_alone_s": rdzv_alone[0] - out["t_kill"] if rdzv_alone else None,
        "recover_s": shrink["unix_time"] - out["t_kill"],
        "agent_up_s": b_up[0] - out["t_restart_b"] if b_up else None,
        "rendezvous_two_s": rdzv_two[0] - out["t_restart_b"] if rdzv_two else None,
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
        ("**time to detect**: kill -> the survivor's collective fails", _s(res["error_s"])),
        ("kill -> the survivor's worker process has exited", _s(res["detect_s"])),
        ("kill -> the survivor's agent has re-rendezvoused alone", _s(res["rendezvous_alone_s"])),
        ("**time to recover**: kill -> restored on 1 rank, training resumes", _s(res["recover_s"])),
        ("  of which the restore itself (pool, load, re-commit)", _s(res["restore_s"][0])),
        ("**steps redone** after the kill", f"{res['redone'][0]} (restored step {res['restored_steps'][0]})"),
        ("agent b started again -> its agent is up and rendezvousing", _s(res["agent_up_s"])),
        ("agent b started again -> two-agent rendezvous complete", _s(res["rendezvous_two_s"])),
        ("**time to grow**: agent b started again -> restored on 2 ranks", _s(res["grow_s"])),
        ("**steps redone** when growing", f"{res['redone'][1]} (restored step {res['restored_steps'][1]})"),
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
    p.add_argument("--out", default=None, help="directory for elastic.json and the run's files (work/)")
    args = p.parse_args()
    if args.out:  # the agents' logs and the metrics stay in OUT/work
        work = Path(args.out) / "work"
        shutil.rmtree(work, ignore_errors=True)
        res = measure(args, work)
        (Path(args.out) / "elastic.json").write_text(json.dumps(res, indent=1))
    else:
        with tempfile.TemporaryDirectory(prefix="dtlab-elastic-") as tmp:
            res = measure(args, Path(tmp))
    print(table(res))
    ok = res["exit_codes"] == {"a": 0, "b": 0} and res["final_step"] == args.steps
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
