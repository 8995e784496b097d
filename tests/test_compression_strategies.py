"""GradientCompressionOptimizer composed with DDP, ZeRO-1 (both gradient_sync modes), ZeRO-2, ZeRO-3
and FSDP on 4 in-memory ranks, and on Gloo and MPI at 2 ranks.

One world per strategy runs every check: ``Dense`` through the compression path reproduces the
uncompressed strategy bit for bit; every lossless-at-density-1 algorithm matches plain single-process
training on the same global batch; every algorithm at density 0.1 trains, keeps ranks identical and
reports statistics (all-reduce semantics for DDP and ZeRO-1 with ``gradient_sync="all_reduce"``,
reduce-scatter for ZeRO-1's default ``gradient_sync``, ZeRO-2/3 and FSDP).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.compression import (
    QSGD,
    CompressedReducer,
    Compressor,
    Dense,
    GaussianK,
    GTopk,
    OkTopk,
    PowerSGD,
    RandomK,
    TopkA,
    TopkDSA,
)
from dtlab.errors import StrategyError
from dtlab.models import (
    DDPModel,
    FSDPModel,
    HybridShardedModel,
    SizePolicy,
    ZeRO1Model,
    ZeRO2Model,
    ZeRO3Model,
)
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.testing import run_world

torch.set_num_threads(1)

P, STEPS, BATCH, LR = 4, 3, 32, 0.2


def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3))
    return filled(net, 0, scale=0.3)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _build(kind: str, backend: CommunicationBackend) -> Any:
    net = _net()
    if kind == "ddp":
        return DDPOptimizer(DDPModel(net, backend, bucket_cap_mb=0.002), torch.optim.SGD, lr=LR)
    if kind == "zero1":  # ZeRO-1's default gradient_sync: each rank gets the average of its shard
        return ZeRO1Optimizer(ZeRO1Model(net, backend), torch.optim.SGD, lr=LR)
    if kind == "zero1_allreduce":
        return ZeRO1Optimizer(ZeRO1Model(net, backend, gradient_sync="all_reduce"), torch.optim.SGD, lr=LR)
    if kind == "zero2":
        return ZeRO2Optimizer(ZeRO2Model(net, backend), torch.optim.SGD, lr=LR)
    if kind == "zero3":
        return ZeRO3Optimizer(ZeRO3Model(net, backend, persistence_threshold=0), torch.optim.SGD, lr=LR)
    fsdp = FSDPModel(net, backend, wrap_policy=SizePolicy(min_num_params=100))
    return ZeRO3Optimizer(fsdp, torch.optim.SGD, lr=LR)


def _train(opt: Any, backend: CommunicationBackend) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    per = BATCH // backend.world_size
    stats = []
    for step in range(STEPS):
        x, y = _data(step)
        sl = slice(backend.rank * per, (backend.rank + 1) * per)
        opt.zero_grad()
        opt.model.train_step((x[sl], y[sl]), nn.functional.cross_entropy)
        opt.step()
        stats.append(dict(getattr(opt, "statistics", {})))
    return {k: v.detach().clone() for k, v in opt.model.full_state_dict().items()}, stats


def _reference() -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


LOSSLESS: list[Compressor] = [
    TopkA(density=1.0),
    TopkDSA(density=1.0),
    GTopk(density=1.0),
    OkTopk(density=1.0, warmup_steps=0, tau=1),  # thresholds recomputed every step: lossless
    RandomK(density=1.0),
]
LOSSY: list[Compressor] = [
    TopkA(density=0.1),
    TopkDSA(density=0.1),
    GTopk(density=0.1),
    GaussianK(density=0.1),
    OkTopk(density=0.1, warmup_steps=1, tau=2, tau_prime=2),
    RandomK(density=0.1),
    QSGD(),
    PowerSGD(rank=1, warmup_steps=1),
]


def _world(backend: CommunicationBackend, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"plain": _train(_build(kind, backend), backend)[0]}
    out["dense"] = _train(GradientCompressionOptimizer(_build(kind, backend), Dense()), backend)
    for comp in LOSSLESS + LOSSY:
        opt = GradientCompressionOptimizer(_build(kind, backend), comp, dense_below=64)
        out[comp.describe()] = _train(opt, backend)
    return out


KINDS = ["ddp", "zero1", "zero1_allreduce", "zero2", "zero3", "fsdp"]


def engines_world(backend: CommunicationBackend) -> dict[str, dict[str, Any]]:
    """Every strategy x every algorithm in one spawned world (module level: processes import it)."""
    torch.set_num_threads(1)
    return {kind: _world(backend, kind) for kind in KINDS}


def _check(results: list[dict[str, Any]], kind: str, ref: dict[str, torch.Tensor]) -> None:
    p = len(results)
    plain = results[0]["plain"]
    for name, t in ref.items():
        torch.testing.assert_close(plain[name], t, rtol=1e-5, atol=1e-6)
    dense_params, dense_stats = results[0]["dense"]
    for name in plain:  # Dense through the compression path: bit for bit the uncompressed strategy
        assert torch.equal(dense_params[name], plain[name]), name
    assert dense_stats[-1]["algorithm"] == "dense" and dense_stats[-1]["density"] == 1.0
    for comp in LOSSLESS + LOSSY:
        params, stats = results[0][comp.describe()]
        for r in range(1, p):  # identical on every rank
            other = results[r][comp.describe()][0]
            assert all(torch.equal(other[n], params[n]) for n in params), (kind, comp.name, r)
        assert all(torch.isfinite(t).all() for t in params.values()), comp.name
        last = stats[-1]
        assert last["algorithm"] == comp.name and last["calls"] >= 1, (comp.name, last)
        # all-reduce semantics for DDP and ZeRO-1(all_reduce), reduce-scatter (no gather phase) for
        # ZeRO-1 (default gradient_sync), ZeRO-2/3 and FSDP
        sharded = kind in ("zero1", "zero2", "zero3", "fsdp")
        assert last["reduce_scatter_calls"] == (last["calls"] if sharded else 0), (kind, comp.name, last)
        assert not any(isinstance(v, float) and math.isnan(v) for v in last.values()), last
        if comp in LOSSLESS:  # density 1: exactly dense, so single-process parity
            for name, t in ref.items():
                torch.testing.assert_close(
                    params[name], t, rtol=1e-5, atol=1e-6, msg=f"{kind} {comp.name} {name}"
                )
        else:
            assert any(not torch.equal(params[n], plain[n]) for n in params), f"{comp.name} did not compress"
            smaller = last["bytes_sent"] < last["dense_bytes"]
            assert smaller or comp.name == "qsgd", (kind, comp.name, last)


@pytest.mark.parametrize("kind", KINDS)
def test_every_algorithm_composes_with_the_strategy(kind: str) -> None:
    _check(run_world(P, _world, kind, timeout=120), kind, _reference())


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_every_algorithm_and_strategy_on_real_engines(engine: str) -> None:
    """ONE spawned 2-process world per engine runs all strategies x all algorithms."""
    from dtlab.testing import spawn_world

    if engine == "mpi":
        pytest.importorskip("mpi4py")
    results = spawn_world(2, engines_world, backend=engine, timeout=240)
    ref = _reference()
    for kind in KINDS:
        _check([r[kind] for r in results], kind, ref)


def _resume(backend: CommunicationBackend) -> dict[str, Any]:
    def build() -> GradientCompressionOptimizer:
        return GradientCompressionOptimizer(_build("zero2", backend), TopkA(density=0.1), dense_below=64)

    def step(opt: GradientCompressionOptimizer, s: int) -> None:
        x, y = _data(s)
        per = BATCH // backend.world_size
        sl = slice(backend.rank * per, (backend.rank + 1) * per)
        opt.zero_grad()
        opt.model.train_step((x[sl], y[sl]), nn.functional.cross_entropy)
        opt.step()

    a = build()
    for s in range(2):
        step(a, s)
    model_shards = backend.all_gather_object(a.model.sharded_state_dict())
    shards = backend.all_gather_object(a.sharded_state_dict())
    b = build()
    b.model.load_sharded_state_dict(model_shards)
    b.load_sharded_state_dict(shards)
    same_residuals = a.reducer.error_feedback.keys() == b.reducer.error_feedback.keys() and all(
        torch.equal(a.reducer.error_feedback.residual(k), b.reducer.error_feedback.residual(k))  # type: ignore[arg-type]
        for k in a.reducer.error_feedback.keys()
    )
    step(a, 2)
    step(b, 2)
    pa, pb = a.model.full_state_dict(), b.model.full_state_dict()
    return {
        "same_residuals": same_residuals,
        "keys": a.reducer.error_feedback.keys(),
        "same_params": all(torch.equal(pa[n], pb[n]) for n in pa),
        "memory": a.memory_report(),
        "inner": type(a.remove()).__name__,
        "reducer_back": type(a.model.gradient_reducer).__name__,
    }


def test_checkpoint_resume_keeps_residuals_and_remove_restores_the_reducer() -> None:
    for r in run_world(2, _resume):
        assert r["keys"] and r["same_residuals"] and r["same_params"]
        assert r["memory"]["compression_residuals"] > 0
        assert r["inner"] == "ZeRO2Optimizer" and r["reducer_back"] == "DenseReducer"


def _statistics_per_step(backend: CommunicationBackend) -> list[tuple[int, int]]:
    """A CompressedReducer set on the model itself (no GradientCompressionOptimizer restarting its step
    after each opt.step()): reduce_accumulated_grads() starts a step, as a synchronized backward does."""
    model = DDPModel(_net(), backend, bucket_cap_mb=0.002)
    model.gradient_reducer = CompressedReducer(backend, TopkA(density=0.3), dense_below=0)
    x, y = _data(backend.rank)
    out = []
    for sync in (False, False, True):
        if sync:
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            with model.no_sync():
                nn.functional.cross_entropy(model(x), y).backward()
            model.reduce_accumulated_grads()
        stats = model.gradient_reducer.step_statistics()
        out.append((stats["calls"], stats["numel"]))
        model.zero_grad_buffers()
    return out


def test_reduce_accumulated_grads_starts_a_step_of_the_reducer() -> None:
    numel = sum(p.numel() for p in _net().parameters())
    for res in run_world(2, _statistics_per_step, timeout=30):  # (calls, elements) of one step each
        assert res[0] == res[1] == res[2] and res[0][0] > 1 and res[0][1] >= numel, res


class _Branchy(nn.Module):
    """A head ``aux`` that the forward uses only when ``use_aux``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(12, 40), nn.Linear(40, 3), nn.Linear(40, 3)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.aux(h) if self.use_aux else self.b(h)


def _unused_after_use(backend: CommunicationBackend, kind: str, set_to_none: bool) -> tuple[str, float]:
    """``aux`` used in step 0, by no rank in steps 1-2 (find_unused_parameters=True, TopkA at 10%):
    the refusal's text (or "") and the mass error: every rank's raw gradients summed minus (every
    rank's residual plus P times the applied SGD update at lr 1)."""
    net = filled(_Branchy(), 0, scale=0.3)
    if kind == "hybrid":  # the composition forwards the flag to its data-parallel strategy
        mesh = Mesh(backend, {"pp": 1, "dp": backend.world_size, "tp": 1})
        dp: Any = HybridShardedModel(net, mesh, data_parallel="ddp", find_unused_parameters=True)
    else:
        dp = (DDPModel if kind == "ddp" else ZeRO2Model)(net, backend, find_unused_parameters=True)
    inner = (ZeRO2Optimizer if kind == "zero2" else DDPOptimizer)(dp, torch.optim.SGD, lr=1.0)
    opt = GradientCompressionOptimizer(inner, TopkA(density=0.1, warmup_steps=0), dense_below=0)
    per = BATCH // backend.world_size
    raw = applied = 0.0
    try:
        for step in range(3):
            x, y = (t[backend.rank * per : (backend.rank + 1) * per] for t in _data(step))
            net.use_aux = step == 0
            plain = filled(_Branchy(), 0)
            plain.load_state_dict(net.state_dict())
            plain.use_aux = net.use_aux
            loss = nn.functional.cross_entropy(plain(x), y)
            grads = torch.autograd.grad(loss, list(plain.parameters()), allow_unused=True)
            raw += sum(float(g.sum()) for g in grads if g is not None)
            before = [p.detach().clone() for p in net.parameters()]
            opt.zero_grad(set_to_none=set_to_none)
            dp.train_step((x, y), nn.functional.cross_entropy)
            opt.step()
            after = [p.detach() for p in net.parameters()]
            applied += sum(float((b - a).sum()) for b, a in zip(before, after, strict=True))
    except StrategyError as e:
        return str(e), math.nan
    ef = opt.reducer.error_feedback
    residual = sum(float(r.sum()) for r in map(ef.residual, ef.keys()) if r is not None)
    mass = torch.tensor([raw - residual - applied])
    backend.all_reduce(mass)  # summed over the ranks: P times the applied update
    return "", float(mass[0])


def _no_backward(backend: CommunicationBackend) -> tuple[str, float]:
    """A step without a backward after ``aux`` left a residual: the model's refusal, not the skip's."""
    net = filled(_Branchy(), 0, scale=0.3)
    dp = DDPModel(net, backend, find_unused_parameters=True)
    inner = DDPOptimizer(dp, torch.optim.SGD, lr=1.0)
    opt = GradientCompressionOptimizer(inner, TopkA(density=0.1, warmup_steps=0), dense_below=0)
    per = BATCH // backend.world_size
    x, y = (t[backend.rank * per : (backend.rank + 1) * per] for t in _data(0))
    dp.train_step((x, y), nn.functional.cross_entropy)
    opt.step()
    opt.zero_grad()
    try:
        opt.step()  # forgot the backward
    except StrategyError as e:
        return str(e), math.nan
    return "", math.nan


def _unused_world(backend: CommunicationBackend) -> dict[tuple[str, bool], tuple[str, float]]:
    kinds = ("ddp", "zero2", "hybrid")
    out = {(k, s): _unused_after_use(backend, k, s) for k in kinds for s in (True, False)}
    return {**out, ("no backward", True): _no_backward(backend)}


def test_a_skipped_parameter_with_a_residual_is_refused_not_dropped() -> None:
    """find_unused_parameters=True under lossy compression: a parameter no rank used in a step is left
    out of it (torch skips a .grad of None) while the exchange sent part of its residual. That update
    is refused, naming the parameter and zero_grad(set_to_none=False), with which nothing is lost."""
    for res in run_world(2, _unused_world, timeout=60):
        for kind in ("ddp", "zero2", "hybrid"):
            text, _ = res[(kind, True)]
            assert "aux.weight" in text and "set_to_none=False" in text, (kind, text)
            text, mass = res[(kind, False)]
            assert text == "" and abs(mass) < 1e-4, (kind, text, mass)
        text, _ = res[("no backward", True)]  # named as a missing backward, not as skipping every parameter
        assert "found no synchronized gradients" in text and "no rank used" not in text, text
