"""ElasticOptimizer under torchrun elastic, two agents on this machine (c10d rendezvous on 127.0.0.1,
free ports, every process killed by PID at the end): one agent is killed with its worker and its
node-local commit directory, the other restarts alone and resumes from the last commit (the lost
node's shards come from its ring copy); the agent is started again and the job grows back to two.
The logged losses follow an uninterrupted in-memory run of the same configuration."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dtlab.config import load_config
from dtlab.testing import TINY_LM
from dtlab.testing.torchrun_elastic import TorchrunJob, shrink_and_grow
from dtlab.trainers import run_training

WORKER = str(Path(__file__).with_name("_elastic_worker.py"))
STEPS, EVERY = 60, 5


def test_torchrun_two_agents_shrink_and_grow_back(tmp_path: Path) -> None:
    common = [
        *TINY_LM,
        "optimizer.warmup_steps=1",
        "train.eval_every=0",
        "logging.progress=false",
        "logging.log_every=1",
        f"train.steps={STEPS}",
        f"elastic.commit_every={EVERY}",
    ]
    run = tmp_path / "run"
    nodes = {n: tmp_path / f"node-{n}" for n in ("a", "b")}
    # no loss.png (matplotlib on each world's way out: seconds per restart; tests/test_run_logging.py
    # checks the plot)
    launch = [
        *common,
        "backend.name=gloo",
        "backend.timeout=60",
        f"logging.run_dir={run}",
        "logging.plot=false",
    ]
    with TorchrunJob([WORKER, "0.3", "0.05", *launch], tmp_path / "agents") as job:
        try:
            out = shrink_and_grow(
                job,
                run / "metrics.jsonl",
                {n: [f"elastic.dir={d}"] for n, d in nodes.items()},
                lost_disk=nodes["b"],
                kill_after=2 * EVERY + 2,
                timeout=150,
            )
        except Exception:
            print(job.log("a")[-6000:], job.log("b")[-3000:])
            raise
    assert out["exit_codes"] == {"a": 0, "b": 0}
    shrink, grow = out["restores"]
    assert (shrink["from_world_size"], shrink["world_size"]) == (2, 1)
    assert (grow["from_world_size"], grow["world_size"]) == (1, 2)
    # the kill loses the steps since the last commit: at most N redone
    last = out["last_step_before_restore"][0]
    assert shrink["step"] % EVERY == 0 and 0 <= last - shrink["step"] <= EVERY, (shrink, last)
    assert shrink["step"] >= out["last_step_before_kill"] - EVERY
    # growing is planned: torchrun's SIGTERM stops every worker after one step, which commits it
    assert out["last_step_before_restore"][1] == grow["step"]
    losses: dict[int, float] = {}
    for rec in out["records"]:
        if "loss" in rec:
            losses[rec["step"]] = rec["loss"]  # a redone step's later value is the trajectory's
    assert sorted(losses) == list(range(1, STEPS + 1))
    # an uninterrupted in-memory run at 2 ranks: the same trajectory up to the world size's round-off
    local = ["backend.name=inmemory", "backend.world_size=2", "logging.run_dir=null"]
    ref = run_training(load_config(overrides=[*common, *local]))[0].losses
    for step, loss in ref:
        assert math.isfinite(losses[step]) and losses[step] == pytest.approx(loss, rel=1e-4), step
