"""A training step that raises on every rank and is caught (a bad batch skipped): the next steps equal
plain training over the same batches minus the bad one, for every data-parallel strategy and optimizer,
with the exception raised partway through backward (a custom autograd Function, a tensor hook),
partway through the forward, or in the loss function. After a backward raised partway the gradients
are partial: forward, backward and step are refused until ``opt.zero_grad()``, as the error says
(inside ``no_sync()`` too; under gradient compression until the reducer's state is cleared, when
a buffer's reduction changed its state). What the raised backward launched is waited for before
``zero_grad()`` returns. ZeRO-3/FSDP free the units the raised step gathered (counted in bytes, exactly)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from raised_cases import BAD, CASES, STEPS, BadBatch, Trap
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
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.compression import TopkA
from dtlab.core.reducer import DenseReducer
from dtlab.errors import StrategyError
from dtlab.optimizers import GradientCompressionOptimizer
from dtlab.testing import run_world

BATCH = 4
# one bucket per layer but the Block's bias alone (the last layer's 132 bytes fill the first bucket):
# when backward raises inside the Block, bucket 0 is launched and the other four are not
SMALL_BUCKETS = 140 / 2**20


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
    base = name.removesuffix("_all_reduce")  # ZeRO-1 with gradient_sync="all_reduce": DDP's reduction
    kw = {"gradient_sync": "all_reduce"} if base != name else {}
    model = wrap(base, module, backend, **_options(base), **kw)
    opt = optimizer_for(base, model, opt_name)
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
                out["parameters_after_eval"] = model.memory_report()["parameters"]  # and cleans up
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
@pytest.mark.parametrize("name", [*STRATEGIES, "zero1_all_reduce"])
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
                else:
                    assert res["parameters_after_eval"] == rest, (case, res["parameters_after_eval"], rest)
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
    a forward and reduce_accumulated_grads() refused until zero_grad(), then two steps of two
    micro-batches (one in no_sync(), one synchronized)."""
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
    for call in (lambda: model(x[0, :1]), model.reduce_accumulated_grads):
        try:
            call()
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
        assert len(refused) == 2 and all("opt.zero_grad()" in m for m in refused), refused
        err = max_rel_error(state, ref)
        assert err <= 1e-5, f"{name} rank {rank}: off by {err:.3g}"


class _CountedWork(Work):
    def __init__(self, inner: Work, waited: list[Work]) -> None:
        self.inner, self.waited = inner, waited

    def wait(self) -> int | None:
        self.waited.append(self)
        return self.inner.wait()


class _CountingReducer(DenseReducer):
    """The strategies' own reduction, keeping every work it hands out and those waited for."""

    def __init__(self, backend: CommunicationBackend) -> None:
        super().__init__(backend)
        self.launched: list[Work] = []
        self.waited: list[Work] = []

    def all_reduce(self, key: str, grad: torch.Tensor) -> Work:
        return self._counted(super().all_reduce(key, grad))

    def reduce_scatter(self, key: str, grad: torch.Tensor, shard: torch.Tensor) -> Work:
        return self._counted(super().reduce_scatter(key, grad, shard))

    def _counted(self, work: Work) -> Work:
        self.launched.append(_CountedWork(work, self.waited))
        return self.launched[-1]


def _waited(backend: CommunicationBackend, name: str) -> tuple[int, int]:
    """A backward raising partway: what it launched is waited for before zero_grad() returns (an
    asynchronous engine would otherwise write the reduction into the buffers zero_grad() cleared)."""
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    trap = Trap()
    module[1].register_forward_hook(trap.after_block)
    model = wrap(name, module, backend, **_options(name))
    model.gradient_reducer = reducer = _CountingReducer(backend)
    opt = optimizer_for(name, model, "sgd")
    trap.case = "backward_function"
    with pytest.raises(BadBatch):
        nn.functional.mse_loss(model(x[0, :2]), y[0, :2]).backward()
    opt.zero_grad()
    return len(reducer.launched), len({id(w) for w in reducer.waited})


@pytest.mark.parametrize("name", STRATEGIES)
def test_what_a_raised_backward_launched_is_waited_for_by_zero_grad(name: str) -> None:
    for launched, waited in run_world(2, _waited, name, timeout=30):
        assert launched > 0 and waited == launched, (launched, waited)


def _compressed(
    backend: CommunicationBackend, name: str, where: str, momentum: float | None = None, dense_below: int = 0
) -> dict[str, Any]:
    """Under gradient compression with error feedback, the buffers a raised backward already reduced
    changed their residuals: refused (naming clear_state() and the checkpoint) until clear_state(); a
    backward raising before any buffer was reduced (in the last layer) changes nothing and needs only
    zero_grad(). ``where``: the Block (after the last layer's bucket/unit was reduced) or the last layer."""
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    trap = Trap()
    module[1 if where == "block" else 3].register_forward_hook(trap.after_block)
    model = wrap(name, module, backend, **_options(name))
    inner = optimizer_for(name, model, "sgd" if momentum is None else "sgd_plain")
    opt = GradientCompressionOptimizer(
        inner, TopkA(density=0.3), dense_below=dense_below, momentum_correction=momentum
    )
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


def test_a_raised_backward_over_dense_buffers_is_refused_only_under_momentum_correction() -> None:
    """Buffers below ``dense_below`` go through the dense path: it keeps no state, so a backward raising
    after one of them was reduced needs only zero_grad(), but with momentum correction the dense path
    updated the buffer's velocity: refused until clear_state()."""
    for res in run_world(2, _compressed, "ddp", "block", None, 10**6, timeout=30):
        assert res["seen"] == [] and res["finite"], res["seen"]
    for res in run_world(2, _compressed, "ddp", "block", 0.9, 10**6, timeout=30):
        assert len(res["seen"]) == 1 and "clear_state()" in res["seen"][0] and res["finite"], res["seen"]
