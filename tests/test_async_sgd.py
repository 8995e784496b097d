"""AsyncSGDOptimizer on the in-memory backend: staleness 0 is synchronous data parallelism, the bound
holds under any worker delays, it learns under staleness 2 and None, failures are named, server
state round-trips, and the bytes are exact."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
from filled import filled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import ArgumentError, CollectiveTimeoutError, RankFailedError, StrategyError
from dtlab.optimizers import AsyncSGDOptimizer
from dtlab.optimizers._async_comm import Note, PushMessage, pieces_of
from dtlab.testing import run_world


def make_net(seed: int = 0) -> nn.Module:
    return filled(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), seed, scale=0.5)


def batches(steps: int, n: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, n, 5, generator=g)
    w = torch.randn(5, 3, generator=g)
    return x, x @ w + 0.05 * torch.randn(steps, n, 3, generator=g)


def train(
    b: CommunicationBackend, net0: nn.Module, staleness: int | None, servers: int, steps: int, **opt: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[float]]:
    """Every worker trains on its contiguous part of each global batch; returns the final state on
    every rank, this rank's stats and a worker's losses."""
    x, y = batches(steps)
    net = copy.deepcopy(net0)
    o = AsyncSGDOptimizer(net, b, torch.optim.SGD, staleness=staleness, num_servers=servers, **opt)
    losses: list[float] = []
    if o.is_server:
        o.serve()
    else:
        w, i = b.world_size - servers, b.rank - servers
        for t in range(steps):
            loss = nn.functional.mse_loss(o.module(x[t].chunk(w)[i]), y[t].chunk(w)[i])
            loss.backward()
            o.step()
            losses.append(loss.item())
        o.finish()
    state = o.full_state_dict()
    assert all(torch.equal(o.module.state_dict()[k], v) for k, v in state.items())  # loaded on every rank
    return state, o.stats(), losses


def plain(net0: nn.Module, steps: int, **opt: Any) -> dict[str, torch.Tensor]:
    x, y = batches(steps)
    net = copy.deepcopy(net0)
    sgd = torch.optim.SGD(net.parameters(), **opt)
    for t in range(steps):
        sgd.zero_grad()
        nn.functional.mse_loss(net(x[t]), y[t]).backward()
        sgd.step()
    return net.state_dict()


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)


@pytest.mark.parametrize(("servers", "workers", "opt"), [
    (1, 2, {"lr": 0.1}),
    (2, 2, {"lr": 0.1, "momentum": 0.9}),
    (2, 4, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
])  # fmt: skip
def test_staleness_0_is_synchronous_sgd_on_the_global_batch(
    servers: int, workers: int, opt: dict[str, Any]
) -> None:
    net0 = make_net()
    res = run_world(servers + workers, train, net0, 0, servers, 5, timeout=30, **opt)
    want = plain(net0, 5, **opt)
    assert rel_err(res[0][0], want) <= 1e-5
    for state, stats, _ in res:  # every rank gets the same full state; nobody ran ahead
        assert all(torch.equal(state[k], res[0][0][k]) for k in want)
        assert stats["max_staleness"] == 0
    assert all(r[1]["updates"] == 5 for r in res[:servers])  # one optimizer step per clock


@pytest.mark.parametrize("staleness", [2, None])
def test_learns_under_bounded_and_unbounded_staleness(staleness: int | None) -> None:
    net0 = make_net()
    res = run_world(4, train, net0, staleness, 1, 30, timeout=30, lr=0.05)
    x, y = batches(30)
    net = copy.deepcopy(net0)
    net.load_state_dict(res[0][0])
    with torch.no_grad():
        before = float(nn.functional.mse_loss(net0(x.reshape(-1, 5)), y.reshape(-1, 3)))
        after = float(nn.functional.mse_loss(net(x.reshape(-1, 5)), y.reshape(-1, 3)))
    assert after < 0.2 * before, (before, after)
    assert res[0][1]["updates"] == 3 * 30  # one optimizer step per push
    if staleness is not None:
        assert max(r[1]["max_staleness"] for r in res) <= staleness


def test_bytes_are_exact() -> None:
    steps, servers, workers = 4, 2, 3
    net0 = make_net()
    res = run_world(servers + workers, train, net0, None, servers, steps, timeout=30, lr=0.1)
    numels = [p.numel() for p in net0.parameters()]
    c = -(-sum(numels) // servers)
    # header (16 bytes, a flag byte per parameter piece of the shard, padded to whole floats) + shard
    push = [
        PushMessage(c, torch.float32, torch.device("cpu"), len(pieces_of(numels, c, k))).nbytes
        for k in range(2)
    ]
    assert push == [4 * (5 + c), 4 * (5 + c)]  # 16 + 1 and 16 + 4 flag bytes: 5 floats
    answer = Note.nbytes(workers) + 4 * c  # note + shard, per server (no WAIT notes without a bound)
    for stats in res[servers:]:
        assert stats[1]["pushes"] == steps and stats[1]["pulls"] == steps
        assert stats[1]["bytes_sent"] == sum(push) * (steps + 1)  # pushes + the finish
        assert stats[1]["bytes_received"] == servers * steps * answer  # one pull per step
    for k, stats in enumerate(res[:servers]):
        assert stats[1]["bytes_received"] == workers * (steps + 1) * push[k]
        assert stats[1]["bytes_sent"] == workers * steps * answer


# ---------------------------------------------------------------------------------------------- the bound
class Probe(nn.Module):
    """One parameter per (worker, clock): the gradient a worker pushes at clock c is ``W`` at its own
    entry, so with SGD(lr=1) an entry is -1 exactly when that push has been applied."""

    def __init__(self, workers: int, steps: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(workers, steps))


def probe_run(
    b: CommunicationBackend, s: int | None, servers: int, delays: list[list[int]], log: list[Any], lock: Any
) -> dict[str, Any]:
    workers = b.world_size - servers
    steps = max(len(d) for d in delays)
    opt = AsyncSGDOptimizer(
        Probe(workers, steps), b, torch.optim.SGD, lr=1.0, staleness=s, num_servers=servers
    )
    if opt.is_server:
        opt.serve()
        return opt.stats()
    i = b.rank - servers
    reads = [opt.module.p.detach().clone()]
    with lock:
        log.append(("start", i, 0))
    for c, ms in enumerate(delays[i]):
        time.sleep(ms / 1000)
        (opt.module.p[i, c] * workers).backward()
        with lock:
            log.append(("push", i, c))
        opt.step()
        reads.append(opt.module.p.detach().clone())
        with lock:
            log.append(("start", i, c + 1))
    with lock:
        log.append(("finish", i, len(delays[i])))
    opt.finish()
    return {**opt.stats(), "reads": reads}


def check_ssp(log: list[Any], results: list[Any], s: int | None, servers: int, workers: int) -> None:
    pushed, finished = [0] * workers, [False] * workers
    for kind, i, c in log:  # replay: a worker starts clock c only when every unfinished one pushed c - s
        if kind == "push":
            pushed[i] += 1
        elif kind == "finish":
            finished[i] = True
        elif s is not None:
            lag = [v for v in range(workers) if not finished[v] and pushed[v] < c - s]
            assert not lag, f"worker {i} started clock {c} while workers {lag} had pushed {pushed} (s={s})"
    steps = [len(r["reads"]) - 1 for r in results[servers:]]
    for i, res in enumerate(results[servers:]):
        assert s is None or res["max_staleness"] <= s
        for t, read in enumerate(res["reads"]):  # what a read at clock t sees
            applied = read == -1
            assert bool(((read == 0) | applied).all())  # every update is applied whole, once
            own = applied[i]
            assert bool(own[:t].all()) and not bool(own[t:].any())  # its own pushes, read-your-writes
            if s is not None:  # every update of clocks <= t - s - 1, maybe more
                for v in range(workers):
                    assert bool(applied[v, : max(0, min(t - s, steps[v]))].all()), (i, t, v)
            if s == 0:  # synchronous: exactly the clocks before t of every worker
                want = torch.zeros_like(applied)
                for v in range(workers):
                    want[v, : min(t, steps[v])] = True
                assert torch.equal(applied, want), (i, t)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    workers=st.integers(2, 4),
    servers=st.integers(1, 2),
    s=st.sampled_from([0, 1, 2, 3, None]),
)
def test_the_staleness_bound_holds_under_random_worker_delays(
    data: st.DataObject, workers: int, servers: int, s: int | None
) -> None:
    delays = [
        data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6), label=f"delays of worker {i} (ms)")
        for i in range(workers)
    ]
    log: list[Any] = []
    results = run_world(servers + workers, probe_run, s, servers, delays, log, threading.Lock(), timeout=30)
    check_ssp(log, results, s, servers, workers)


def test_a_slow_worker_holds_the_others_back_exactly_s_clocks() -> None:
    delays = [[0] * 6, [0] * 6, [15] * 6]  # worker 2 is slow: the others must wait for it
    for s in (0, 2):
        log: list[Any] = []
        results = run_world(4, probe_run, s, 1, delays, log, threading.Lock(), timeout=30)
        check_ssp(log, results, s, 1, 3)
        assert max(r["max_staleness"] for r in results[1:]) == s
        assert results[1]["waits"] > 0 and results[0]["waits"] > 0


# ---------------------------------------------------------------------------------------------- failures
def dies(b: CommunicationBackend, how: str, saved: dict[str, Any], at: int = 3) -> dict[str, Any] | None:
    net = make_net()
    x, y = batches(8)
    opt = AsyncSGDOptimizer(net, b, torch.optim.SGD, lr=0.05, momentum=0.9, staleness=1)
    if opt.is_server:
        opt.serve(on_update=lambda o: saved.__setitem__("server", o.state_dict()))
        return None
    for t in range(8):
        if b.rank == 2 and t == at:
            if how == "raise":
                raise RuntimeError("worker 2 lost its data")
            return None  # leaves without finish(): silent to everyone else
        nn.functional.mse_loss(opt.module(x[t]), y[t]).backward()
        opt.step()
    opt.finish()
    return None


def resumes(b: CommunicationBackend, state: dict[str, Any]) -> dict[str, Any]:
    net = make_net(seed=5)  # other initial values: the loaded state must replace them
    x, y = batches(8)
    opt = AsyncSGDOptimizer(net, b, torch.optim.SGD, lr=0.05, momentum=0.9, staleness=1)
    out: dict[str, Any] = {}
    opt.load_state_dict(state if opt.is_server else None)  # collective: every rank
    if opt.is_server:
        out["loaded"] = opt.state_dict()
        opt.serve()
    else:
        out["first_read"] = torch.nn.utils.parameters_to_vector(opt.module.parameters()).clone()
        out["losses"] = []
        for t in range(8):
            loss = nn.functional.mse_loss(opt.module(x[t]), y[t])
            loss.backward()
            opt.step()
            out["losses"].append(loss.item())
        opt.finish()
    return out


def test_a_dead_worker_is_named_and_the_server_state_survives() -> None:
    saved: dict[str, Any] = {}
    with pytest.raises(RankFailedError) as info:
        run_world(3, dies, "raise", saved, timeout=30)
    assert info.value.rank == 2 and "worker 2 lost its data" in str(info.value)
    state = saved["server"]
    assert state["role"] == "server" and 3 <= state["updates"] <= 3 + 5  # rank 1: clocks 0..4 at most
    res = run_world(3, resumes, state, timeout=30)
    loaded = res[0]["loaded"]
    assert torch.equal(loaded["shard"], state["shard"]) and loaded["updates"] == state["updates"]
    momentum = state["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], momentum)
    numel = sum(p.numel() for p in make_net().parameters())
    for worker in res[1:]:  # the workers' clock-0 read is the restored shard
        assert torch.equal(worker["first_read"], state["shard"][:numel])
        assert worker["losses"][-1] < worker["losses"][0]


def test_a_silent_worker_is_named_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        run_world(3, dies, "leave", {}, timeout=1.5)
    assert info.value.missing_ranks == (2,), str(info.value)
    assert "rank(s) [2]" in str(info.value) and "dead or hung" in str(info.value)
    assert time.monotonic() - t0 < 15


def leaves_before_serving(b: CommunicationBackend) -> None:
    opt = AsyncSGDOptimizer(make_net(), b, torch.optim.SGD, lr=0.1, num_servers=2)
    if b.rank == 1:  # server 0 built it too, but leaves without serving
        opt.serve()
    elif b.rank > 1:
        nn.functional.mse_loss(opt.module(torch.ones(2, 5)), torch.zeros(2, 3)).backward()
        opt.step()


def test_a_server_that_never_serves_is_named() -> None:
    with pytest.raises(CollectiveTimeoutError) as info:
        run_world(4, leaves_before_serving, timeout=1.5)
    assert 0 in info.value.missing_ranks and "server rank 0" in str(info.value)


# ---------------------------------------------------------------------------------------------- usage errors
def misuse(b: CommunicationBackend) -> dict[str, str]:
    errors: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
        except (StrategyError, ArgumentError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    catch("servers", lambda: AsyncSGDOptimizer(make_net(), b, torch.optim.SGD, lr=0.1, num_servers=3))
    catch("staleness", lambda: AsyncSGDOptimizer(make_net(), b, torch.optim.SGD, lr=0.1, staleness=-1))
    catch("class", lambda: AsyncSGDOptimizer(make_net(), b, torch.optim.SGD(make_net().parameters(), lr=1)))
    net = make_net() if b.rank != 2 else nn.Linear(5, 3)
    catch("model", lambda: AsyncSGDOptimizer(net, b, torch.optim.SGD, lr=0.1))
    opt = AsyncSGDOptimizer(make_net(), b, torch.optim.SGD, lr=0.1, staleness=None)
    if opt.is_server:
        catch("step", opt.step)
        catch("load", lambda: opt.load_state_dict({"role": "server", "num_servers": 2, "numel": 1}))
        opt.serve()
        catch("serve twice", opt.serve)
    else:
        catch("serve", opt.serve)
        catch("optimizer", lambda: opt.optimizer)
        catch("early", opt.full_state_dict)
        opt.finish()
        catch("step after finish", opt.step)
    opt.full_state_dict()
    return errors


def test_misuse_is_one_clear_error() -> None:
    res = run_world(3, misuse, timeout=30)
    server, worker = res[0], res[1]
    assert "leaves no worker" in server["servers"] and "staleness must be an int" in server["staleness"]
    assert "torch.optim.Optimizer class" in server["class"]
    assert "rank 2 built it with" in server["model"] or "rank 2 built it with" in res[2]["model"]
    assert "is for workers" in server["step"] and "branch on opt.is_server" in server["step"]
    assert "cannot load a state saved by a server of 2 servers" in server["load"]
    assert "already served" in server["serve twice"]
    assert "is for servers" in worker["serve"] and "live on the servers" in worker["optimizer"]
    assert "must call finish() first" in worker["early"] and "after finish()" in worker["step after finish"]
