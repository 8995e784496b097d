"""A step skipped for a non-finite gradient on one rank (``nonfinite="skip"``, ``grads_are_finite()``
then ``zero_grad()`` without ``step()``, as the Trainer's guard does) leaves no trace in the compression
state: the run equals the same run without that step, bitwise, though the other buckets went through
the compressor (their residuals, velocities and iteration counts changed and are put back). Under
momentum correction a second synchronized backward in one step is refused, naming ``no_sync()``."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import Compressor, Dense, OkTopk, TopkA
from dtlab.models import DDPModel, ZeRO2Model
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.testing import run_world

torch.set_num_threads(1)

STEPS, BAD, BATCH = 5, 2, 8


def _net() -> nn.Module:
    return filled(
        nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3)), 0
    )


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _opt(b: CommunicationBackend, kind: str, comp: Compressor, mc: float | None) -> Any:
    net = _net()
    model = (
        DDPModel(net, b, bucket_cap_mb=0.002) if kind == "ddp" else ZeRO2Model(net, b, bucket_cap_mb=0.002)
    )
    inner = (DDPOptimizer if kind == "ddp" else ZeRO2Optimizer)(
        model, torch.optim.SGD, lr=0.1, momentum=0.0 if mc else 0.9, weight_decay=0.01
    )
    return GradientCompressionOptimizer(inner, comp, dense_below=0, momentum_correction=mc, nonfinite="skip")


def _train(
    b: CommunicationBackend, kind: str, comp: Compressor, mc: float | None, bad: bool
) -> dict[str, Any]:
    """``bad``: at step BAD rank 1's first-layer bias gets an infinite gradient (every other bucket stays
    finite and is exchanged) and the step is skipped; else step BAD is left out altogether."""
    opt = _opt(b, kind, comp, mc)
    net = opt.model.module
    for step in range(STEPS):
        if step == BAD and not bad:
            continue
        opt.zero_grad()
        hook = None
        if step == BAD and b.rank == 1:
            hook = net[0].bias.register_hook(lambda g: g + float("inf"))
        x, y = _batch(step, b.rank, b.world_size)
        nn.functional.cross_entropy(opt.model(x), y).backward()
        if hook is not None:
            hook.remove()
        if opt.grads_are_finite():
            opt.step()
    return {k: v.clone() for k, v in opt.model.full_state_dict().items()}


def test_a_skipped_step_leaves_no_trace_in_the_compression_state() -> None:
    """Before, the buckets exchanged in the skipped step kept its batch in their residuals (and, under
    momentum correction, the velocities of the ranks whose gradient was finite): 0.8-1.6% relative
    away from the run without that step."""
    cases: list[tuple[Compressor, float | None]] = [
        (TopkA(density=0.3, warmup_steps=0), None),
        (OkTopk(density=0.3, warmup_steps=0, tau=1, tau_prime=1), None),
        (TopkA(density=0.3, warmup_steps=0), 0.9),
        (Dense(), 0.9),  # the dense path of momentum correction: a velocity, no residual
    ]
    for kind in ("ddp", "zero2"):
        for comp, mc in cases:
            skipped = run_world(2, _train, kind, comp, mc, True, timeout=60)
            without = run_world(2, _train, kind, comp, mc, False, timeout=60)[0]
            for got in skipped:
                for k, want in without.items():
                    assert torch.equal(got[k], want), (kind, comp.name, mc, k)


def _two_synchronized_backwards(b: CommunicationBackend) -> str:
    opt = _opt(b, "ddp", TopkA(density=0.3, warmup_steps=0), 0.9)
    x, y = _batch(0, b.rank, b.world_size)
    opt.zero_grad()
    nn.functional.cross_entropy(opt.model(x), y).backward()
    try:
        nn.functional.cross_entropy(opt.model(x), y).backward()  # accumulation outside no_sync()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_momentum_correction_refuses_a_second_synchronized_backward_in_a_step() -> None:
    """Before, each synchronized backward took a momentum step of the velocity: 6.5% (DDP) and 1.2%
    (ZeRO-2) relative from torch's SGD(momentum) over 5 steps of 2 accumulated backwards."""
    for text in run_world(2, _two_synchronized_backwards, timeout=60):
        assert (
            text.startswith("StrategyError") and "model.no_sync()" in text and "reduced a second time" in text
        ), text
