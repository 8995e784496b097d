"""Momentum correction (Deep Gradient Compression, Lin et al. 2018) in the compressed reducer:
``u = m*u + g; v += u``; send the compressor's selection of ``v``; zero ``u`` and ``v`` where sent.
Checked against a direct implementation of that rule, under DDP and ZeRO-2, with Dense (plain
momentum SGD), and across a checkpoint resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.compression import Compressor, Dense, OkTopk, TopkA
from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.errors import ConfigError, StrategyError
from dtlab.models import DDPModel, ZeRO2Model
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.testing import run_world

M, LR, K, STEPS, P = 0.9, 0.1, 5, 6, 2


def _net() -> nn.Module:
    return filled(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), 0, scale=0.5)  # 83 parameters


def _batch(s: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * s + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _build(
    backend: CommunicationBackend, compressor: Compressor, zero2: bool, momentum: float = 0.0, wd: float = 0.0
) -> GradientCompressionOptimizer:
    kw = {"lr": LR, "momentum": momentum, "weight_decay": wd}
    if zero2:
        inner: Any = ZeRO2Optimizer(ZeRO2Model(_net(), backend), torch.optim.SGD, **kw)
    else:
        inner = DDPOptimizer(DDPModel(_net(), backend), torch.optim.SGD, **kw)
    mc = None if momentum else M
    return GradientCompressionOptimizer(inner, compressor, dense_below=0, momentum_correction=mc)


def _step(opt: GradientCompressionOptimizer, backend: CommunicationBackend, s: int) -> None:
    opt.zero_grad()
    opt.model.train_step(_batch(s, backend.rank), nn.functional.cross_entropy)
    opt.step()


def _train(
    backend: CommunicationBackend, compressor: Compressor, zero2: bool, momentum: float, wd: float = 0.0
) -> Any:
    opt = _build(backend, compressor, zero2, momentum, wd)
    for s in range(STEPS):
        _step(opt, backend, s)
    return [p.detach().clone() for p in opt.model.module.parameters()]


def _reference() -> list[torch.Tensor]:
    """DGC with TopkA's exchange (average of every rank's local top-K of ``v``), written out."""
    net = _net()
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    u, v = [torch.zeros(n) for _ in range(P)], [torch.zeros(n) for _ in range(P)]
    for s in range(STEPS):
        total = torch.zeros(n)
        for r in range(P):
            net.zero_grad()
            nn.functional.cross_entropy(net(_batch(s, r)[0]), _batch(s, r)[1]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            u[r] = g + M * u[r]
            v[r] += u[r]
            idx = v[r].abs().topk(K).indices
            total[idx] += v[r][idx]
            u[r][idx] = 0.0  # momentum factor masking
            v[r][idx] = 0.0
        update, off = total / P, 0
        with torch.no_grad():
            for p in params:
                p -= LR * update[off : off + p.numel()].view_as(p)
                off += p.numel()
    return [p.detach() for p in params]


@pytest.mark.parametrize("zero2", [False, True], ids=["ddp", "zero2"])
def test_momentum_correction_follows_the_dgc_rule(zero2: bool) -> None:
    expected = _reference()
    for params in run_world(P, _train, TopkA(density=K / 83), zero2, 0.0):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dense_with_momentum_correction_is_momentum_sgd() -> None:
    corrected = run_world(P, _train, Dense(), False, 0.0)
    plain = run_world(P, _train, Dense(), False, M)
    assert not torch.equal(plain[0][0], _net()[0].weight)  # it trained
    for a, b in zip(corrected[0], plain[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _torch_momentum_sgd(wd: float) -> list[torch.Tensor]:
    """One process, torch's SGD(momentum=M, weight_decay=wd) on the global batch of every step."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=M, weight_decay=wd)
    for s in range(STEPS):
        xs, ys = zip(*(_batch(s, r) for r in range(P)), strict=True)
        opt.zero_grad()
        nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("zero2", [False, True], ids=["ddp", "zero2"])
@pytest.mark.parametrize("compressor", [Dense(), TopkA(density=1.0)], ids=["dense", "topka-density-1"])
def test_uncompressed_momentum_correction_with_weight_decay_is_torch_momentum_sgd(
    compressor: Compressor, zero2: bool
) -> None:
    """The weight decay has a velocity of its own (DGC's optimizer; torch puts it in the momentum
    buffer), and density 1.0 sends dense instead of masking the whole velocity every step."""
    expected = _torch_momentum_sgd(0.05)
    for params in run_world(P, _train, compressor, zero2, 0.0, 0.05):
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _scheduled(backend: CommunicationBackend) -> list[torch.Tensor]:
    inner = DDPOptimizer(DDPModel(_net(), backend), torch.optim.SGD, lr=LR, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(inner.optimizer, 2, 0.5)  # on the local SGD, then wrapped
    opt = GradientCompressionOptimizer(inner, Dense(), momentum_correction=M)
    for s in range(STEPS):
        _step(opt, backend, s)
        schedule.step()
    return [p.detach().clone() for p in opt.model.module.parameters()]


def test_a_scheduler_built_before_wrapping_follows_the_weight_decay_velocity_quietly(
    recwarn: pytest.WarningsRecorder,
) -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=M, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for s in range(STEPS):
        xs, ys = zip(*(_batch(s, r) for r in range(P)), strict=True)
        opt.zero_grad()
        nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        schedule.step()
    for params in run_world(P, _scheduled):
        for got, want in zip(params, net.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert not [w for w in recwarn if "overridden" in str(w.message)]  # torch's check of a replaced step


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        # head b: every rank at step % 3 == 0, rank 0 alone at 1, no rank at 2 (skipped by the step)
        used = step % 3 == 0 or (step % 3 == 1 and rank == 0)
        return self.a(h) + self.b(h) if used else self.a(h)


def _heads() -> nn.Module:
    return filled(_TwoHeads(), 0, scale=0.5)


def _heads_train(
    backend: CommunicationBackend, compressor: Compressor, zero2: bool
) -> dict[str, torch.Tensor]:
    model: Any = (ZeRO2Model if zero2 else DDPModel)(_heads(), backend, find_unused_parameters=True)
    inner: Any = (ZeRO2Optimizer if zero2 else DDPOptimizer)(model, torch.optim.SGD, lr=LR, weight_decay=0.05)
    opt = GradientCompressionOptimizer(inner, compressor, dense_below=0, momentum_correction=M)
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s, backend.rank)
        nn.functional.cross_entropy(model(x, s, backend.rank), y).backward()
        opt.step()
    return dict(model.full_state_dict())


@pytest.mark.parametrize(
    ("compressor", "zero2"),
    [(Dense(), False), (TopkA(density=1.0), True)],
    ids=["dense-ddp", "topka-1-zero2"],
)
def test_a_skipped_parameter_keeps_its_velocity_as_torch_keeps_its_momentum(
    compressor: Compressor, zero2: bool
) -> None:
    net = _heads()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=M, weight_decay=0.05)
    for s in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(net(_batch(s, r)[0], s, r), _batch(s, r)[1]) for r in range(P))
        (loss / P).backward()  # type: ignore[operator]
        opt.step()
    for got in run_world(P, _heads_train, compressor, zero2):
        for k, want in net.state_dict().items():
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)


def test_masking_and_non_finite_leave_the_velocity_right() -> None:
    ef = ErrorFeedback(momentum=0.5)
    acc = ef.accumulate("b", torch.tensor([1.0, 2.0, 3.0]))
    ef.update("b", acc, None, torch.tensor([2]))  # sent index 2
    assert ef.velocity("b").tolist() == [1.0, 2.0, 0.0]  # type: ignore[union-attr]
    assert ef.residual("b").tolist() == [1.0, 2.0, 0.0]  # type: ignore[union-attr]
    acc = ef.accumulate("b", torch.tensor([1.0, 1.0, 1.0]))  # u = [1.5, 2, 1], v = [2.5, 4, 1]
    assert acc.tolist() == [2.5, 4.0, 1.0]
    ef.discard("b", acc)  # a non-finite step: neither residual nor velocity moves
    assert ef.velocity("b").tolist() == [1.0, 2.0, 0.0]  # type: ignore[union-attr]
    acc = ef.accumulate("b", torch.tensor([1.0, 1.0, 1.0]))
    ef.update("b", acc, None, None)  # a dense exchange: everything sent, the velocity kept
    assert ef.residual("b").tolist() == [0.0, 0.0, 0.0]  # type: ignore[union-attr]
    assert ef.velocity("b").tolist() == [1.5, 2.0, 1.0]  # type: ignore[union-attr]


def _refuse(backend: CommunicationBackend) -> list[str]:
    errors = []
    cases: list[tuple[Any, float]] = [
        (DDPOptimizer(DDPModel(_net(), backend), torch.optim.SGD, lr=LR, momentum=0.9), 0.9),
        (DDPOptimizer(DDPModel(_net(), backend), torch.optim.Adam, lr=LR), 0.9),
        (DDPOptimizer(DDPModel(_net(), backend), torch.optim.SGD, lr=LR), 1.5),
    ]
    for inner, m in cases:
        with pytest.raises((StrategyError, ConfigError)) as info:
            GradientCompressionOptimizer(inner, TopkA(density=0.1), momentum_correction=m)
        errors.append(str(info.value))
    return errors


def _cycled(backend: CommunicationBackend) -> str:
    opt = _build(backend, Dense(), False)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)  # cycles momentum
    with pytest.raises(StrategyError) as info:
        for s in range(STEPS):
            _step(opt, backend, s)
            schedule.step()
    return str(info.value)


def test_a_scheduler_cycling_momentum_is_refused_at_the_step() -> None:
    """OneCycleLR's default cycle_momentum=True sets the inner SGD's momentum (0.85-0.95): on top of
    the reducer's it trained 0.149 away from momentum SGD; now refused on every rank."""
    for text in run_world(P, _cycled):
        assert "cycle_momentum=False" in text and "param group 0" in text and "momentum twice" in text


def test_momentum_twice_or_a_bad_factor_is_refused() -> None:
    errors = run_world(1, _refuse)[0]
    assert "momentum=0.9" in errors[0] and "momentum=0" in errors[0]
    assert "Adam" in errors[1]
    assert "1.5" in errors[2] and "(0, 1)" in errors[2]


def _resume(backend: CommunicationBackend, zero2: bool, root: Path) -> dict[str, Any]:
    compressor, half = OkTopk(density=0.1, tau=2, tau_prime=2, warmup_steps=1), 3
    a = _build(backend, compressor, zero2, wd=0.05)  # the weight decay's velocity is saved too
    for s in range(STEPS):
        _step(a, backend, s)
        if s + 1 == half:
            save_checkpoint(
                root, half, backend, a.model.sharded_state_dict(), a.sharded_state_dict(), {}, {"step": half}
            )
    ckpt = read_checkpoint(root)
    assert ckpt.optim is not None
    assert any(k.startswith("compression.velocity.") for k in ckpt.optim[backend.rank].tensors)
    b = _build(backend, compressor, zero2, wd=0.05)
    b.model.load_sharded_state_dict(ckpt.model)
    b.load_sharded_state_dict(ckpt.optim)
    for s in range(half, STEPS):
        _step(b, backend, s)
    pa, pb = a.model.module.parameters(), b.model.module.parameters()
    return {"exact": all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))}


@pytest.mark.parametrize("zero2", [False, True], ids=["ddp", "zero2"])
def test_resume_with_momentum_correction_is_exact(tmp_path: Path, zero2: bool) -> None:
    for r in run_world(P, _resume, zero2, tmp_path / "ck"):
        assert r["exact"]


def _global(s: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of step ``s``'s global batch of 20 (the same global batch at any size)."""
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _resized(backend: CommunicationBackend, compressor: Compressor, saved: Any) -> Any:
    """4 ranks: 3 steps, then every rank's shards; 5 ranks: load them, 3 more steps."""
    opt = _build(backend, compressor, False, wd=0.05)
    if saved is not None:
        opt.model.load_sharded_state_dict(saved[0])
        opt.load_sharded_state_dict(saved[1])
    for s in range(3) if saved is None else range(3, STEPS):
        opt.zero_grad()
        opt.model.train_step(_global(s, backend.rank, backend.world_size), nn.functional.cross_entropy)
        opt.step()
    residuals = {k: opt.reducer.error_feedback.residual(k) for k in opt.reducer.error_feedback.keys()}
    shards = (opt.model.sharded_state_dict(), opt.sharded_state_dict())
    everyone = backend.all_gather_object(shards)
    return [s[0] for s in everyone], [s[1] for s in everyone], residuals, list(opt.model.module.parameters())


@pytest.mark.parametrize("compressor", [Dense(), TopkA(density=0.1)], ids=["dense", "topka-10pct"])
def test_a_resize_keeps_the_mean_residual_and_velocity(compressor: Compressor) -> None:
    """4 -> 5 ranks (the 83-element bucket padded to 84, then 85): each new rank restores the old ranks'
    mean residual and velocity. Dense: momentum SGD with its momentum intact (equal to one process);
    lossy: what the residuals owe is kept."""
    first = run_world(4, _resized, compressor, None)
    saved = (first[0][0], first[0][1])
    then = run_world(5, _resized, compressor, saved)
    if isinstance(compressor, Dense):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=M, weight_decay=0.05)
        for s in range(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(net(_global(s, 0, 1)[0]), _global(s, 0, 1)[1]).backward()
            opt.step()
        for got, want in zip(then[0][3], net.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        return
    reloaded = run_world(5, _reload_resized, compressor, saved)
    for key, old in first[0][2].items():
        owed = sum(r[2][key] for r in first) / 4
        assert old is not None and owed.numel() == 84 and float(owed.abs().sum()) > 0, key
        for new in reloaded:
            torch.testing.assert_close(
                new[key], torch.cat([owed[:83], owed.new_zeros(2)]), rtol=1e-6, atol=1e-7
            )


def _reload_resized(backend: CommunicationBackend, compressor: Compressor, saved: Any) -> Any:
    opt = _build(backend, compressor, False, wd=0.05)
    opt.load_sharded_state_dict(saved[1])
    return {k: opt.reducer.error_feedback.residual(k) for k in opt.reducer.error_feedback.keys()}
