"""Every collective path agrees on failure: a rank that fails while reading input from elsewhere (an
elastic commit, a checkpoint) makes every rank raise the same named error at the next agreement,
within seconds, on Gloo processes as in the in-memory world (no rank waits out a Gloo timeout)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint.agree import agree, read_on_src
from dtlab.core.rng import seeded_init
from dtlab.errors import CheckpointError
from dtlab.models import DDPModel
from dtlab.optimizers import DDPOptimizer
from dtlab.optimizers.elastic import DiskCommitStore, ElasticOptimizer, StaticMember
from dtlab.testing import run_world, spawn_world


def _unreadable() -> bytes:
    raise CheckpointError("the file is corrupted")


def _caught(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _checks(backend: CommunicationBackend, dirs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    out["read"] = _caught(read_on_src, backend, 0, _unreadable, "reading x")
    out["agree"] = _caught(agree, backend, "bad shard" if backend.rank == 1 else None, "reading y")
    # an elastic commit that the rank holding it cannot read (a corrupt file in its node-local store)
    store = DiskCommitStore(dirs[backend.rank])
    with seeded_init(0):  # never torch.manual_seed inside a rank: in-memory ranks share the RNG
        module = nn.Linear(4, 2)
    opt = ElasticOptimizer(
        DDPOptimizer(DDPModel(module, backend), torch.optim.SGD, lr=0.1),
        commit_every=1,
        member=StaticMember(store),
    )
    opt.commit(1, {"step": 1})
    backend.barrier()
    if backend.rank == 0:
        for f in Path(dirs[0]).glob("commit-*"):
            f.write_bytes(b"\x10" + b"\x00" * 7 + b"garbage!" * 4)
    backend.barrier()
    out["elastic"] = _caught(opt.restore)
    out["seconds"] = time.monotonic() - t0
    return out


def _assert_agreed(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "reading x failed on rank 0: CheckpointError: the file is corrupted" in r["read"], r
        assert r["agree"] == "reading y failed on rank [1]: bad shard", r
        assert "elastic: reading the commit (1, 0, 2, 0) failed on rank 0" in r["elastic"], r
        # agreed, not waited out: under the 60 s backend timeout a rank left waiting would reach
        # (20 s was exceeded by a Gloo world at load 25 on 2 cores)
        assert r["seconds"] < 45, r


def test_in_memory_ranks_agree_on_a_failed_read(tmp_path: Path) -> None:
    dirs = [str(tmp_path / f"node{r}") for r in range(2)]
    _assert_agreed(run_world(2, _checks, dirs, timeout=60))


@pytest.mark.timeout(240)
def test_gloo_processes_agree_on_a_failed_read_within_seconds(tmp_path: Path) -> None:
    dirs = [str(tmp_path / f"node{r}") for r in range(2)]
    t0 = time.monotonic()
    results = spawn_world(2, _checks, dirs, backend="gloo", timeout=200, backend_timeout=60)
    _assert_agreed(results)
    assert time.monotonic() - t0 < 120
