"""AsyncSGDOptimizer on real engines, one spawned world each (1 server + 2 workers): staleness 0
equals plain SGD on the global batch, exact bytes, the bound holds with a slow worker; gloo: a killed
server is named by both workers at once; MPI: a hung worker is named by the server and by the worker
it holds back, within the timeout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async_sgd import make_net, plain, rel_err, train
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import CollectiveTimeoutError
from dtlab.optimizers import AsyncSGDOptimizer
from dtlab.optimizers._async_comm import Note, PushMessage
from dtlab.testing import spawn_world

GLOO_TIMEOUT = 20.0  # the gloo group's timeout (a killed server is detected at once)
MPI_TIMEOUT = 2.0  # the timeout of the MPI communicator the hung-worker case runs on


def _warm_up(b: CommunicationBackend) -> None:
    """torch's first optimizer step imports its compiler stack (seconds on a busy machine): do it
    before any bounded wait, on every rank, then line up."""
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    torch.optim.SGD([p], lr=1.0).step()
    b.barrier()


def slow_third(b: CommunicationBackend, comm: CommunicationBackend, s: int) -> dict[str, Any]:
    """Worker rank 2 starts 2 s late and is 20 ms slower per step, so rank 1 reaches the bound however
    loaded the machine is; returns this rank's stats."""
    opt = AsyncSGDOptimizer(make_net(), comm, torch.optim.SGD, lr=0.05, staleness=s)
    if opt.is_server:
        opt.serve()
    else:
        for i in range(6):
            time.sleep((2.0 if i == 0 else 0.02) if b.rank == 2 else 0.0)
            nn.functional.mse_loss(opt.module(torch.ones(4, 5)), torch.zeros(4, 3)).backward()
            opt.step()
        opt.finish()
    return opt.stats()


def failing(b: CommunicationBackend, comm: CommunicationBackend, engine: str) -> tuple[Any, ...] | None:
    """gloo: the server is killed at its third update; MPI: worker rank 2 hangs at clock 2. Under
    staleness 0, so that a worker is held back for rank 2 when the server dies."""
    opt = AsyncSGDOptimizer(make_net(), comm, torch.optim.SGD, lr=0.05, staleness=0)
    t0 = time.monotonic()

    def kill(o: AsyncSGDOptimizer) -> None:
        if engine == "gloo" and o.clock == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        if opt.is_server:
            opt.serve(on_update=kill)
        else:
            for t in range(5):
                if engine == "mpi" and b.rank == 2 and t == 2:
                    time.sleep(MPI_TIMEOUT + 3)  # hung: nothing more from this rank
                    return None
                nn.functional.mse_loss(opt.module(torch.ones(4, 5)), torch.zeros(4, 3)).backward()
                t0 = time.monotonic()
                opt.step()
            opt.finish()
    except CollectiveTimeoutError as exc:
        return (exc.missing_ranks, str(exc), time.monotonic() - t0)
    return ("no error",)


def engine_world(b: CommunicationBackend, engine: str, save: str) -> dict[str, Any]:
    _warm_up(b)
    out: dict[str, Any] = {}
    state, stats, _ = train(b, make_net(), 0, 1, 4, lr=0.1, momentum=0.9)
    out["sync"] = (state, stats)
    state, stats, losses = train(b, make_net(), None, 1, 5, lr=0.05)
    out["free"] = (state, stats, losses)
    out["slow"] = {s: slow_third(b, b, s) for s in (0, 2)}
    b.barrier()
    if engine == "mpi":  # a communicator with a short timeout (the world's has none: MPI blocks)
        from dtlab.backends import MPIBackend

        comm: CommunicationBackend = MPIBackend(b.comm.Dup(), timeout=MPI_TIMEOUT)  # type: ignore[attr-defined]
    else:
        comm = b
    torch.save(out, Path(save, f"rank-{b.rank}.pt"))  # the server's results, should it be killed
    out["failure"] = failing(b, comm, engine)
    return out


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_async_sgd_on_a_real_engine(engine: str, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"backend_timeout": GLOO_TIMEOUT, "may_die": [0]} if engine == "gloo" else {}
    res = spawn_world(3, engine_world, engine, str(tmp_path), backend=engine, timeout=240, **kw)
    res[0] = res[0] or torch.load(tmp_path / "rank-0.pt")
    # staleness 0: synchronous SGD on the global batch; the same full state on every rank
    want = plain(make_net(), 4, lr=0.1, momentum=0.9)
    assert rel_err(res[0]["sync"][0], want) <= 1e-5
    for r in res:
        assert all(torch.equal(r["sync"][0][k], res[0]["sync"][0][k]) for k in want)
        assert r["sync"][1]["max_staleness"] == 0
    assert res[0]["sync"][1]["updates"] == 4
    # no bound: exact bytes (no WAIT notes), it learns
    numel = sum(p.numel() for p in make_net().parameters())
    push = PushMessage(numel, torch.float32, torch.device("cpu"), 4).nbytes  # a flag per parameter (4)
    answer = Note.nbytes(2) + 4 * numel
    server, worker = res[0]["free"][1], res[1]["free"][1]
    assert (worker["bytes_sent"], worker["bytes_received"]) == (6 * push, 5 * answer)  # 5 steps + finish
    assert (server["bytes_sent"], server["bytes_received"]) == (2 * 5 * answer, 2 * 6 * push)
    assert server["updates"] == 10 and res[1]["free"][2][-1] < res[1]["free"][2][0]
    # a slow worker: rank 1 is held back exactly s clocks ahead of it
    for s in (0, 2):
        assert res[1]["slow"][s]["max_staleness"] == s and res[1]["slow"][s]["waits"] > 0
        assert res[0]["slow"][s]["max_staleness"] == s
    # gloo: the killed server is named by both workers at once (one of them held back for the other)
    # MPI: the hung worker is named by the server and by the worker it holds back, within the timeout
    named = [(1, 0), (2, 0)] if engine == "gloo" else [(0, 2), (1, 2)]
    for rank, culprit in named:
        missing, text, seconds = res[rank]["failure"]
        assert missing == (culprit,), text
        assert "dead or hung" in text and (f"rank(s) [{culprit}]" in text or f"rank {culprit} is" in text), (
            text
        )
        assert seconds < (5 if engine == "gloo" else MPI_TIMEOUT + 5), (seconds, text)
