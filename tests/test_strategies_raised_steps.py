"""A training step that raises on every rank and is caught (a bad batch skipped): the next steps equal
plain training over the same batches minus the bad one, for every data-parallel strategy and optimizer,
with the exception raised partway through backward (a custom autograd Function, a tensor hook),
partway through the forward, or in the loss function. After a backward raised partway the gradients
are partial: forward, backward and step are refused until ``opt.zero_grad()``, as the error says.
ZeRO-3/FSDP free the units the raised step gathered (counted in bytes, exactly)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model
from steps import plain_steps
from test_strategies_helpers import (
    OPTIMIZERS,
    STRATEGIES,
    make_data,
    make_module,
    max_rel_error,
    optimizer_for,
    wrap,
)
from test_tensor_helpers import OPTIMIZERS as LM_OPTIMIZERS
from test_tensor_helpers import batch, build, initial_state
from test_tensor_helpers import max_rel_error as lm_rel_error
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import TopkA
from dtlab.errors import CollectiveTimeoutError, StrategyError
from dtlab.optimizers import GradientCompressionOptimizer
from dtlab.testing import run_world

STEPS, BAD, BATCH = 4, 1, 4
CASES = ("backward_function", "backward_hook", "forward", "forward_oom", "loss")
# one bucket per layer but the Block's bias alone (the last layer's 132 bytes fill the first bucket):
# when backward raises inside the Block, bucket 0 is launched and the other four are not
SMALL_BUCKETS = 140 / 2**20


class BadBatch(Exception):
    """The user's own exception for a batch to skip."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BadBatch("a NaN check in backward")


@dataclass
class Trap:
    """Where the current step raises (None: nowhere); one per rank, installed on the Block."""

    case: str | None = None

    def after_block(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self.case == "forward":
            raise BadBatch("a NaN check in the forward")
        if self.case == "forward_oom":  # caught as such to retry with a smaller batch: keeps its type
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.case == "backward_function":
            return _RaiseInBackward.apply(out)
        if self.case == "backward_hook":

            def hook(grad: torch.Tensor) -> None:
                raise BadBatch("a NaN check in a tensor hook")

            out.register_hook(hook)
        return None

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, y)
        if self.case == "loss":
            raise BadBatch("a NaN loss")
        return loss


def _options(name: str) -> dict[str, Any]:
    return {"bucket_cap_mb": SMALL_BUCKETS} if name in ("ddp", "zero1", "zero2") else {}


def _at_rest_bytes(model: Any) -> int:
    """What ZeRO-3/FSDP hold of the parameters between steps: this rank's shard of each unit."""
    return sum(u.shard_numel * u.params[0].element_size() for u in model.shard_units())


def _skip_one(backend: CommunicationBackend, name: str, opt_name: str, case: str) -> dict[str, Any]:
    x, y = make_data(STEPS, BATCH)
    local = BATCH // backend.world_size
    mine = slice(backend.rank * local, (backend.rank + 1) * local)
    module = make_module()
    trap = Trap()
    module[1].register_forward_hook(trap.after_block)  # before wrapping: runs before the strategy's
    model = wrap(name, module, backend, **_options(name))
    opt = optimizer_for(name, model, opt_name)
    out: dict[str, Any] = {"refusals": []}
    for step in range(STEPS):
        trap.case = case if step == BAD else None
        try:
            trap.loss(model(x[step, mine]), y[step, mine]).backward()
        except (BadBatch, torch.OutOfMemoryError):
            trap.case = None
            out["parameters_after_raise"] = model.memory_report()["parameters"]
            if case.startswith("backward"):  # partial gradients: refused until zero_grad()
                with torch.no_grad():
                    model(x[0, mine])  # an evaluation forward is not refused (it reads no gradient)
                for what, call in (("forward", lambda: model(x[0, mine])), ("step", opt.step)):
                    try:
                        call()
                    except StrategyError as exc:
                        out["refusals"].append((what, str(exc)))
                opt.zero_grad()
            out["parameters_recovered"] = model.memory_report()["parameters"]
            continue
        opt.step()
        opt.zero_grad()
        if step == 0:
            out["parameters_at_rest"] = model.memory_report()["parameters"]
    out["expected_at_rest"] = _at_rest_bytes(model)
    out["state"] = model.full_state_dict()
    return out


def _reference(opt_name: str) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    ocls, kw = OPTIMIZERS[opt_name]
    kept = [s for s in range(STEPS) if s != BAD]
    plain_steps(
        module, ocls(module.parameters(), **kw), zip(x[kept], y[kept], strict=True), nn.functional.mse_loss
    )
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_caught_exception_skips_the_batch_like_plain_training(name: str, case: str) -> None:
    for opt_name in ("sgd", "adamw"):
        ref = _reference(opt_name)
        for rank, res in enumerate(run_world(2, _skip_one, name, opt_name, case, timeout=30)):
            err = max_rel_error(res["state"], ref)
            assert err <= 1e-5, f"{name} {opt_name} {case} rank {rank}: off by {err:.3g}"
            if case.startswith("backward"):
                assert [w for w, _ in res["refusals"]] == ["forward", "step"], res["refusals"]
                for _, msg in res["refusals"]:
                    assert "raised partway" in msg and "opt.zero_grad()" in msg, msg
            else:
                assert res["refusals"] == []
            if name in ("zero3", "fsdp"):  # the units the raised step gathered are freed, exactly
                rest = res["expected_at_rest"]
                assert res["parameters_at_rest"] == rest
                if case != "backward_function" and case != "backward_hook":
                    assert res["parameters_after_raise"] == rest, (case, res["parameters_after_raise"], rest)
                assert res["parameters_recovered"] == rest, (case, res["parameters_recovered"], rest)


def _kept_for_backward(backend: CommunicationBackend) -> dict[str, int]:
    """FSDP with reshard_after_forward=False keeps each unit gathered from its forward to its backward:
    when the loss raises in between, the next forward reuses them (no extra gather) and zero_grad()
    frees them; zero_grad() between a forward and its backward only costs a re-gather."""
    x, y = make_data(STEPS, BATCH)
    model = wrap("fsdp", make_module(), backend, reshard_after_forward=False)
    opt = optimizer_for("fsdp", model, "sgd")
    out = {"rest": _at_rest_bytes(model)}
    loss = nn.functional.mse_loss
    model(x[0, :2])  # the loss raised: no backward
    out["after_raise"] = model.memory_report()["parameters"]
    before = backend.stats["all_gather"].calls
    loss(model(x[1, :2]), y[1, :2]).backward()
    out["gathers_reusing"] = backend.stats["all_gather"].calls - before
    opt.step()
    opt.zero_grad()
    before = backend.stats["all_gather"].calls
    loss(model(x[1, :2]), y[1, :2]).backward()
    out["gathers_normal"] = backend.stats["all_gather"].calls - before
    opt.zero_grad()
    model(x[0, :2])
    opt.zero_grad()
    out["after_zero_grad"] = model.memory_report()["parameters"]
    return out


def test_units_kept_for_a_backward_that_never_came_are_reused_or_freed_by_zero_grad() -> None:
    for res in run_world(2, _kept_for_backward, timeout=30):
        assert res["after_raise"] > res["rest"], res  # every unit still gathered for its backward
        assert res["gathers_reusing"] == 0, res  # reused by the next forward and backward
        assert res["gathers_normal"] == 3, res  # one per Linear unit, kept from forward to backward
        assert res["after_zero_grad"] == res["rest"], res


def _accumulating(backend: CommunicationBackend, name: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Gradient accumulation: the second micro-batch's backward raises partway inside ``no_sync()``;
    refused until zero_grad(), then two steps of two micro-batches (one in no_sync(), one synchronized)."""
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    trap = Trap()
    module[1].register_forward_hook(trap.after_block)
    model = wrap(name, module, backend, **_options(name))
    opt = optimizer_for(name, model, "sgd")
    r = backend.rank
    loss = nn.functional.mse_loss
    with model.no_sync():
        loss(model(x[0, 2 * r : 2 * r + 1]), y[0, 2 * r : 2 * r + 1]).backward()
        trap.case = "backward_function"
        with pytest.raises(BadBatch):
            loss(model(x[0, 2 * r + 1 : 2 * r + 2]), y[0, 2 * r + 1 : 2 * r + 2]).backward()
        trap.case = None
    refused = []
    try:
        model(x[0, :1])
    except StrategyError as exc:
        refused.append(str(exc))
    opt.zero_grad()
    for step in (1, 2):
        for m in (0, 1):
            rows = slice(2 * r + m, 2 * r + m + 1)
            with model.no_sync() if m == 0 else contextlib.nullcontext():
                loss(model(x[step, rows]), y[step, rows]).backward()
        opt.step()
        opt.zero_grad()
    return refused, model.full_state_dict()


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_backward_raising_inside_no_sync_is_refused_until_zero_grad(name: str) -> None:
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    ocls, kw = OPTIMIZERS["sgd"]
    opt = ocls(module.parameters(), **kw)
    for step in (1, 2):
        for m in (0, 1):  # each micro-batch: one row of each rank's two, averaged over the ranks
            nn.functional.mse_loss(module(x[step, [m, 2 + m]]), y[step, [m, 2 + m]]).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for rank, (refused, state) in enumerate(run_world(2, _accumulating, name, timeout=30)):
        assert len(refused) == 1 and "opt.zero_grad()" in refused[0], refused
        err = max_rel_error(state, ref)
        assert err <= 1e-5, f"{name} rank {rank}: off by {err:.3g}"


def _compressed(backend: CommunicationBackend, name: str, where: str) -> dict[str, Any]:
    """Under gradient compression with error feedback, the buffers a raised backward already reduced
    changed their residuals: refused (naming clear_state() and the checkpoint) until clear_state(); a
    backward raising before any buffer was reduced (in the last layer) changes nothing and needs only
    zero_grad(). ``where``: the Block (after the last layer's bucket/unit was reduced) or the last layer."""
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    trap = Trap()
    module[1 if where == "block" else 3].register_forward_hook(trap.after_block)
    model = wrap(name, module, backend, **_options(name))
    opt = GradientCompressionOptimizer(optimizer_for(name, model, "sgd"), TopkA(density=0.3), dense_below=0)
    mine = slice(2 * backend.rank, 2 * backend.rank + 2)
    seen = []
    for step in range(STEPS):
        trap.case = "backward_function" if step == BAD else None
        try:
            nn.functional.mse_loss(model(x[step, mine]), y[step, mine]).backward()
        except BadBatch:
            trap.case = None
            opt.zero_grad()
            try:  # the next reduction is refused, and every later one until clear_state()
                for _ in range(2):
                    nn.functional.mse_loss(model(x[step, mine]), y[step, mine]).backward()
                    opt.zero_grad()
            except StrategyError as exc:
                seen.append(str(exc))
            model.gradient_reducer.clear_state()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return {"seen": seen, "finite": all(bool(v.isfinite().all()) for v in model.full_state_dict().values())}


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp"])
def test_a_raised_backward_under_compression_is_refused_until_the_reducer_state_is_cleared(name: str) -> None:
    for res in run_world(2, _compressed, name, "block", timeout=30):
        assert len(res["seen"]) == 1 and res["finite"], res["seen"]
        assert all("clear_state()" in m and "checkpoint" in m for m in res["seen"]), res["seen"]
    for res in run_world(2, _compressed, name, "last_layer", timeout=30):
        assert res["seen"] == [] and res["finite"]


# ---------------------------------------------------------------------------- the composed model
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
