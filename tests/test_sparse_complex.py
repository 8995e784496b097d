"""Sparse gradients (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``) train under every
strategy and composition exactly as the sparse model on one process on the global batch (the gradient
is summed densely); torch.optim.SparseAdam and complex parameters are refused, each with one clear
error at construction. One world of two in-memory ranks for all of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from filled import filled
from refusals import refusal_messages
from test_strategies_helpers import STRATEGIES, wrap
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.compression import Dense, GradientSynchronizer
from dtlab.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import (
    AsyncSGDOptimizer,
    DDPOptimizer,
    GradientCompressionOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from dtlab.optimizers.elastic import ElasticOptimizer
from dtlab.testing import run_world

VOCAB, DIM, STEPS, BATCH, LR = 24, 4, 3, 8, 0.2
OPTIMIZER_OF = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


class Lookup(nn.Module):
    """Both sparse-gradient layers torch has, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.emb(idx).flatten(1), self.bag(idx)], dim=1)


def make() -> nn.Module:
    return filled(nn.Sequential(Lookup(), nn.Linear(4 * DIM, 6), nn.Tanh(), nn.Linear(6, 2)), 0, scale=0.5)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, BATCH, 3), generator=g), torch.randn(STEPS, BATCH, 2, generator=g)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def reference() -> dict[str, torch.Tensor]:
    """The sparse model on one process: SGD with momentum steps its sparse gradients."""
    net, (x, y) = make(), data()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        mse(net(x[s]), y[s]).backward()
        assert net[0].emb.weight.grad is not None and net[0].emb.weight.grad.is_sparse
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _train(name: str, backend: CommunicationBackend) -> dict[str, Any]:
    """STEPS steps of ``name``; each dp rank's half of the batch in two micro-batches, the first
    inside ``no_sync()`` (sparse gradients add up in ``param.grad`` there)."""
    x, y = data()
    kw = {"lr": LR, "momentum": 0.9}
    out: dict[str, Any] = {}
    dp, coord = backend.world_size, backend.rank
    if name == "tensor":  # tp = 2: the embeddings replicated, the first Linear split
        model: Any = TensorParallelModel(make(), backend, {"1": "colwise_gather_output"})
        opt: Any = ZeRO1Optimizer(model, torch.optim.SGD, **kw)
        dp, coord = 1, 0
    elif name == "pipeline":  # pp = 2
        model = PipelineParallelModel(make(), backend, micro_batches=2)
        opt = DDPOptimizer(model, torch.optim.SGD, **kw)
    elif name == "hybrid":
        model = HybridShardedModel(make(), Mesh(backend, {"dp": 2}), "zero3", persistence_threshold=0)
        opt = ZeRO3Optimizer(model, torch.optim.SGD, **kw)
    elif name == "elastic":
        model = wrap("fsdp", make(), backend)
        opt = ElasticOptimizer(ZeRO3Optimizer(model, torch.optim.SGD, **kw), commit_every=1)
    elif name == "compression":
        model = wrap("zero2", make(), backend)
        opt = GradientCompressionOptimizer(ZeRO2Optimizer(model, torch.optim.SGD, **kw), Dense())
    else:
        model = wrap(name, make(), backend)
        opt = OPTIMIZER_OF.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, **kw)
    share = BATCH // dp
    for s in range(STEPS):
        if name == "pipeline":
            model.train_step((x[s], y[s]), mse)
        else:
            xs, ys = x[s, coord * share : (coord + 1) * share], y[s, coord * share : (coord + 1) * share]
            with model.no_sync():
                (mse(model(xs[: share // 2]), ys[: share // 2]) / 2).backward()
            if name == "zero2":  # the sparse gradient kept in no_sync() counts its rows and indices
                held = [p.grad for p in model.module.parameters() if p.grad is not None]
                out["sparse_bytes"] = model.memory_report()["gradients"] - sum(
                    g.numel() * 4 for g in [*held, *model.norm_grad_tensors()[0]] if not g.is_sparse
                )
                out["sparse_expected"] = sum(
                    g._values().numel() * 4 + g._indices().numel() * 8 for g in held if g.is_sparse
                )
            (mse(model(xs[share // 2 :]), ys[share // 2 :]) / 2).backward()
        if name == "ddp":  # what the optimizer sees, and what it costs
            grad = model.module[0].emb.weight.grad
            out["dense_grad"] = grad is not None and grad.layout == torch.strided
            out["grad_bytes"] = model.memory_report()["gradients"]
        opt.step()
        if name == "ddp" and s == 0:
            model.zero_grad()  # nn.Module's: param.grad None, the next one arrives sparse
        else:
            opt.zero_grad()
    out["state"] = model.full_state_dict()
    return out


def _async(backend: CommunicationBackend) -> dict[str, torch.Tensor]:
    """One server, one worker on the global batch, staleness 0: synchronous SGD."""
    x, y = data()
    opt = AsyncSGDOptimizer(make(), backend, torch.optim.SGD, num_servers=1, lr=LR, momentum=0.9)
    if opt.is_server:
        opt.serve()
    else:
        for s in range(STEPS):
            mse(opt.module(x[s]), y[s]).backward()
            opt.step()
        opt.finish()
    return opt.full_state_dict()


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.w = nn.Parameter(torch.ones(3, 3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).to(torch.complex64) @ self.w).abs()


class FrozenComplex(nn.Module):
    """Complex tensors that need no reduction: a frozen parameter and a buffer (rotary tables)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = filled(nn.Linear(3, 4), 2)
        value = torch.polar(torch.ones(4, 4), torch.arange(16.0).view(4, 4)) * (rank == 0)
        self.f = nn.Parameter(value, requires_grad=False)  # rank 1 starts wrong: rank 0's values come
        self.register_buffer("rot", value.conj().resolve_conj())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).to(torch.complex64) @ (self.f * self.rot)).abs()


def _frozen_complex(name: str, backend: CommunicationBackend) -> dict[str, torch.Tensor]:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    if name == "tensor":
        model: Any = TensorParallelModel(
            FrozenComplex(backend.rank), backend, {"lin": "colwise_gather_output"}
        )
        opt: Any = ZeRO1Optimizer(model, torch.optim.SGD, lr=LR)
        mine = x
    else:
        model = wrap(name, FrozenComplex(backend.rank), backend)
        opt = OPTIMIZER_OF.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=LR)
        mine = x[backend.rank :: 2]
    for _ in range(2):
        model(mine).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def _frozen_complex_reference() -> dict[str, torch.Tensor]:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    net = FrozenComplex(0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(2):
        net(x[[0, 2, 1, 3]]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def _refusals(backend: CommunicationBackend) -> dict[str, list[str]]:
    mesh = Mesh(backend, {"pp": 2})
    sparse_adam: list[Callable[[], object]] = [
        lambda: DDPOptimizer(wrap("ddp", make(), backend), torch.optim.SparseAdam, lr=0.1),
        lambda: ZeRO1Optimizer(wrap("zero1", make(), backend), torch.optim.SparseAdam(make().parameters())),
        lambda: AsyncSGDOptimizer(make(), backend, torch.optim.SparseAdam, lr=0.1),
    ]
    complex_: list[Callable[[], object]] = [
        *(lambda n=n: wrap(n, Complex(), backend) for n in STRATEGIES),
        lambda: HybridShardedModel(Complex(), Mesh(backend, {"dp": 2}), "fsdp"),
        lambda: TensorParallelModel(Complex(), backend, {"lin": "colwise_gather_output"}),
        lambda: PipelineParallelModel(nn.Sequential(Complex(), nn.Linear(3, 1)), mesh, micro_batches=2),
        lambda: AsyncSGDOptimizer(Complex(), backend, torch.optim.SGD, lr=0.1),
    ]
    return {"sparse_adam": refusal_messages(sparse_adam), "complex": refusal_messages(complex_)}


NAMES = (*STRATEGIES, "tensor", "pipeline", "hybrid", "elastic", "compression")


def _synchronizer(backend: CommunicationBackend) -> list[bool]:
    """GradientSynchronizer (a user's own loop) averages a sparse gradient into a dense one."""
    x, y = data()
    net = make()
    mse(net(x[0, backend.rank :: 2]), y[0, backend.rank :: 2]).backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    mine = {n: g.to_dense() for n, g in grads.items()}
    every = backend.all_gather_object(mine)
    got = GradientSynchronizer(Dense(), backend).sync(grads)
    return [torch.allclose(got[n], (every[0][n] + every[1][n]) / 2, atol=1e-7) for n in grads]


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {name: _train(name, backend) for name in NAMES}
    out["synchronizer"] = _synchronizer(backend)
    out["frozen_complex"] = {n: _frozen_complex(n, backend) for n in (*STRATEGIES, "tensor")}
    out["async"] = {"state": _async(backend)}
    out["refused"] = _refusals(backend)
    return out


def test_sparse_gradients_train_exactly_and_the_rest_is_refused_clearly() -> None:
    ref = reference()
    ranks = run_world(2, _world, timeout=120)
    for res in ranks:
        for name in (*NAMES, "async"):
            got = res[name]["state"]
            assert set(got) == set(ref), name
            err = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            assert err < 1e-5, (name, err)
        # under DDP the optimizer sees a dense gradient, as large as the parameters: the cost of the
        # dense reduction (5 parameters of the model, float32)
        assert res["ddp"]["dense_grad"]
        assert res["ddp"]["grad_bytes"] == 4 * sum(v.numel() for v in ref.values())
        assert 0 < res["zero2"]["sparse_bytes"] == res["zero2"]["sparse_expected"], res["zero2"]
        for name, got in res["frozen_complex"].items():  # broadcast as real pairs, never reduced
            want = _frozen_complex_reference()
            assert set(got) == set(want), name
            assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6, name
        assert res["synchronizer"] == [True] * 6, res["synchronizer"]
        adam, cplx = res["refused"]["sparse_adam"], res["refused"]["complex"]
        assert len(adam) == 3 and all("SparseAdam steps sparse gradients only" in m for m in adam), adam
        assert all("torch.optim.Adam" in m for m in adam), adam
        assert len(cplx) == 9, cplx
        assert all("w' (torch.complex64)" in m and "torch.view_as_real" in m for m in cplx), cplx
