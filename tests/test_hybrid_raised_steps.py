"""The composed model (``HybridShardedModel``) when a training step raises and is caught: with tensor
parallelism (tp=2 x dp=2, every data-parallel strategy, the exception raised partway through backward,
in the forward or in the loss) the next steps equal plain training minus the bad batch; inside a
pipeline schedule (pp=2 x tp=2) the step raises on one stage while the others wait, so every later
``train_step`` is refused, and the way to skip a bad batch is deciding together after ``train_step``
(``opt.grads_are_finite()``); with one stage per rank ``opt.zero_grad()`` is enough."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model
from raised_cases import BAD, CASES, STEPS, BadBatch, Trap
from test_strategies_helpers import STRATEGIES
from test_tensor_helpers import OPTIMIZERS as LM_OPTIMIZERS
from test_tensor_helpers import batch, build, initial_state
from test_tensor_helpers import max_rel_error as lm_rel_error
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import CollectiveTimeoutError, StrategyError
from dtlab.testing import run_world


def _lm_reference(kept: list[int]) -> dict[str, torch.Tensor]:
    cls, kwargs, dtype = LM_OPTIMIZERS["sgd"]
    net = build(initial_state(), dtype)
    opt = cls(net.parameters(), **kwargs)
    for step in kept:
        x, y = batch(10 + step)
        nn.functional.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _hybrid_skip_one(
    backend: CommunicationBackend, data_parallel: str, cases: tuple[str, ...]
) -> dict[str, Any]:
    """tp=2 x dp=2 without a pipeline: per case, a fresh model trained STEPS steps, step BAD raising."""
    cls, kwargs, _ = LM_OPTIMIZERS["sgd"]
    out: dict[str, Any] = {}
    for case in cases:
        model = hybrid_model(backend, {"dp": 2, "tp": 2}, data_parallel)
        trap = Trap()
        model.dp_strategy.module.blocks[1].register_forward_hook(trap.after_block)
        opt = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
        dp, coord = model.mesh.size("dp"), model.mesh.coordinate("dp")
        refused = []
        for step in range(STEPS):
            trap.case = case if step == BAD else None
            x, y = (t.chunk(dp)[coord] for t in batch(10 + step))
            try:
                logits = model(x)
                if trap.case == "loss":
                    raise BadBatch("a NaN loss")
                model.cross_entropy(logits, y).backward()
            except (BadBatch, torch.OutOfMemoryError):
                trap.case = None
                if case.startswith("backward"):
                    try:
                        model(x)
                    except StrategyError as exc:
                        refused.append(str(exc))
                    opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        out[case] = (refused, model.full_state_dict())
    return out


@pytest.mark.parametrize("data_parallel", STRATEGIES)
def test_the_composed_model_with_tensor_parallelism_skips_a_batch_like_plain_training(
    data_parallel: str,
) -> None:
    ref = _lm_reference([s for s in range(STEPS) if s != BAD])
    for rank, res in enumerate(run_world(4, _hybrid_skip_one, data_parallel, CASES, timeout=60)):
        for case, (refused, state) in res.items():
            err = lm_rel_error(state, ref)
            assert err <= 1e-5, f"{data_parallel} {case} rank {rank}: off by {err:.3g}"
            assert len(refused) == case.startswith("backward"), (case, refused)
            assert all("opt.zero_grad()" in msg for msg in refused), refused


def _pipeline_raise(backend: CommunicationBackend, data_parallel: str) -> list[str]:
    """pp=2 x tp=2: the loss raises on the last stage's ranks; the first stage's ranks wait for the
    gradient until the timeout. Every rank then refuses the next train_step, naming the fix."""
    model = hybrid_model(backend, {"pp": 2, "tp": 2}, data_parallel, micro_batches=2)
    cls, kwargs, _ = LM_OPTIMIZERS["sgd"]
    opt = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
    bad = {"on": True}

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if bad["on"]:
            raise BadBatch("a NaN loss")
        return model.cross_entropy(logits, y)

    seen = []
    for _ in range(2):
        try:
            model.train_step(batch(10), loss_fn)
        except (BadBatch, CollectiveTimeoutError, StrategyError) as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        opt.zero_grad()
        bad["on"] = False
    return seen


def _pipeline_skip_by_agreement(backend: CommunicationBackend, data_parallel: str) -> dict[str, torch.Tensor]:
    """The way to skip a bad batch under a pipeline: train_step completes on every rank (the loss is
    NaN), then opt.grads_are_finite() agrees to zero_grad() instead of step()."""
    model = hybrid_model(backend, {"pp": 2, "tp": 2}, data_parallel, micro_batches=2)
    cls, kwargs, _ = LM_OPTIMIZERS["sgd"]
    opt = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
    for step in range(STEPS):

        def loss_fn(logits: torch.Tensor, y: torch.Tensor, nan: bool = step == BAD) -> torch.Tensor:
            loss = model.cross_entropy(logits, y)
            return loss * float("nan") if nan else loss

        model.train_step(batch(10 + step), loss_fn)
        if opt.grads_are_finite():
            opt.step()
        opt.zero_grad()
    return model.full_state_dict()


@pytest.mark.parametrize("data_parallel", ["ddp", "zero3"])
def test_a_step_raising_inside_a_pipeline_is_refused_after_and_skipped_by_agreement(
    data_parallel: str,
) -> None:
    for rank, seen in enumerate(run_world(4, _pipeline_raise, data_parallel, timeout=3)):
        first = "BadBatch" if rank >= 2 else "CollectiveTimeoutError"  # ranks 2, 3: the last stage
        assert seen[0].startswith(first), (rank, seen)
        assert seen[1].startswith("StrategyError") and "restart from the last checkpoint" in seen[1], seen
        assert "opt.grads_are_finite()" in seen[1], seen[1]
    ref = _lm_reference([s for s in range(STEPS) if s != BAD])
    for rank, state in enumerate(run_world(4, _pipeline_skip_by_agreement, data_parallel, timeout=60)):
        err = lm_rel_error(state, ref)
        assert err <= 1e-5, f"{data_parallel} pipeline rank {rank}: off by {err:.3g}"


def _one_stage_skip(
    backend: CommunicationBackend, data_parallel: str
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """One stage per rank (dp=2, two micro-batches): the second micro-batch's loss raises on every rank
    after the first one's gradients accumulated; the next train_step is refused until zero_grad()."""
    model = hybrid_model(backend, {"dp": 2}, data_parallel, micro_batches=2)
    cls, kwargs, _ = LM_OPTIMIZERS["sgd"]
    opt = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
    calls = {"n": 0, "bad": False}

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["bad"] and calls["n"] == 2:
            raise BadBatch("a NaN loss")
        return model.cross_entropy(logits, y)

    refused = []
    for step in range(STEPS):
        calls["n"], calls["bad"] = 0, step == BAD
        x, y = (t.chunk(2)[backend.rank] for t in batch(10 + step))
        try:
            model.train_step((x, y), loss_fn)
        except BadBatch:
            try:
                model.train_step((x, y), loss_fn)
            except StrategyError as exc:
                refused.append(str(exc))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return refused, model.full_state_dict()


@pytest.mark.parametrize("data_parallel", ["zero1", "fsdp"])
def test_one_stage_per_rank_skips_a_batch_after_zero_grad(data_parallel: str) -> None:
    ref = _lm_reference([s for s in range(STEPS) if s != BAD])
    for rank, (refused, state) in enumerate(run_world(2, _one_stage_skip, data_parallel, timeout=60)):
        assert len(refused) == 1 and "opt.zero_grad()" in refused[0], refused
        err = lm_rel_error(state, ref)
        assert err <= 1e-5, f"{data_parallel} one stage rank {rank}: off by {err:.3g}"
