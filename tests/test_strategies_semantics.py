"""Semantics of the data-parallel strategies beyond parity: every replica starts from rank 0's values and
``full_state_dict()`` loads into a plain module, DDP launches buckets during backward, ZeRO-1's
reduce-scattered gradients behave like DDP's all-reduced ones, ZeRO-3's persistence threshold and
ZeRO-3/FSDP prefetch change what is gathered, and ``reduce_dtype`` sets the dtype on the wire."""

from __future__ import annotations

import io
from functools import partial
from typing import Any

import pytest
import torch
from filled import filled
from test_strategies_helpers import OPTIMIZERS, STRATEGIES, max_rel_error, optimizer_for, wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import DDPModel, DenseReducer, FSDPModel, ModuleClassPolicy, ZeRO1Model, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world


def _net(seed: int, width: int = 8) -> nn.Module:
    """A Linear-BatchNorm-Linear net whose parameters and buffers depend on ``seed``."""
    module = nn.Sequential(nn.Linear(5, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), module[1].running_mean, module[1].running_var]:
            t.copy_(torch.rand(t.shape, generator=g) + 0.5)
        module[1].num_batches_tracked.fill_(seed)
    return module


# ---------------------------------------------------------------------------- construction, full state
def _from_rank0(
    backend: CommunicationBackend, name: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
    model = wrap(name, _net(seed=10 + backend.rank), backend)  # every rank builds different values
    full = model.full_state_dict()
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(4, 5))
    model.train()
    model(torch.full((4, 5), float(backend.rank)))  # each rank's running statistics move apart
    model.eval()
    model(torch.ones(4, 5))  # every forward with gradients starts from rank 0's buffers (torch DDP's)
    return full, out, model.module[1].running_mean.clone()


def test_every_replica_starts_from_rank0_and_full_state_loads_into_a_plain_module() -> None:
    expected = _net(seed=10)
    expected.eval()
    with torch.no_grad():
        expected_out = expected(torch.ones(4, 5))
    for name in STRATEGIES:
        results = run_world(3, _from_rank0, name, timeout=30)
        means = [r[2] for r in results]
        assert not torch.equal(means[0], expected[1].running_mean), name  # the training forward moved it
        assert all(torch.equal(m, means[0]) for m in means), f"{name}: buffers not rank 0's: {means}"
        for rank, (full, out, _) in enumerate(results):
            assert list(full) == list(expected.state_dict()), f"{name}: keys differ from state_dict()"
            plain = _net(seed=99)
            plain.load_state_dict(full)  # strict: exactly the plain module's keys and shapes
            for key, value in expected.state_dict().items():
                assert torch.equal(plain.state_dict()[key], value), f"{name} rank {rank}: {key}"
            assert int(full["1.num_batches_tracked"]) == 10, f"{name}: buffers come from rank 0"
            assert torch.equal(out, expected_out), f"{name} rank {rank}: forward not on rank 0's values"


# ---------------------------------------------------------------------------- DDP buckets overlap backward
class _Recorder(DenseReducer):
    def __init__(self, backend: CommunicationBackend, events: list[str]) -> None:
        super().__init__(backend)
        self.events = events

    def all_reduce(self, key: str, grad: torch.Tensor) -> Any:
        self.events.append(f"launch {key}")
        return super().all_reduce(key, grad)


def _overlap(backend: CommunicationBackend) -> tuple[list[str], int, float, int]:
    with seeded_init(0):  # never torch.manual_seed inside a rank: in-memory ranks share the RNG
        module = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16 640 bytes per layer
        plain = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    default = DDPModel(plain, backend)
    model = DDPModel(module, backend, bucket_cap_mb=16_640 / 2**20)  # one bucket per layer
    events: list[str] = []
    model.gradient_reducer = _Recorder(backend, events)

    # the first layer's backward is the last one autograd runs: mark when it starts
    def mark(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: events.append("layer 0 starts"))

    module[0].register_forward_hook(mark)
    model(torch.randn(2, 64)).sum().backward()
    return events, len(model.shard_units()), default.bucket_cap_mb, len(default.shard_units())


def test_ddp_buckets_are_launched_during_backward() -> None:
    events, buckets, default_cap, default_buckets = run_world(2, _overlap, timeout=30)[0]
    assert default_cap == 25.0 and default_buckets == 1  # 25 MiB by default: the 66 KB model is one bucket
    assert buckets == 4
    assert events[:3] == ["launch bucket0", "launch bucket1", "launch bucket2"], events
    assert events[3:] == ["layer 0 starts", "launch bucket3"], events


# ---------------------------------------------------------------------------- ZeRO-1 gradient semantics
def _zero1(backend: CommunicationBackend, mode: str) -> dict[str, Any]:
    # SGD with momentum, not AdamW: the bias before BatchNorm has an exactly zero gradient, so its
    # computed gradient is rounding noise (summed in another order by ZeRO-1), which AdamW's first
    # step turns into +-lr; momentum keeps a doubled or halved accumulated gradient visible
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(4, 4, 5, generator=g), torch.randn(4, 4, 3, generator=g)
    r = backend.rank
    out: dict[str, Any] = {}
    for name in ("ddp", mode):
        module = _net(seed=1)
        if name == "ddp":
            model: Any = DDPModel(module, backend, broadcast_buffers=False)
            opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
        else:
            sync = "all_reduce" if mode == "zero1_all_reduce" else "reduce_scatter"
            model = ZeRO1Model(module, backend, gradient_sync=sync, broadcast_buffers=False)
            opt = ZeRO1Optimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
        norms = []
        for step in range(2):  # two synchronized backwards per step, no zero_grad between them
            for micro in range(2):
                i = 2 * step + micro
                nn.functional.mse_loss(model(xs[i, 2 * r : 2 * r + 2]), ys[i, 2 * r : 2 * r + 2]).backward()
            with torch.enable_grad():
                model(xs[0, :2])  # a forward without backward changes nothing
            norms.append(float(opt.clip_grad_norm_(1e9)))
            opt.step()
            opt.zero_grad()
        out[name] = (model.full_state_dict(), norms)
    model.module(xs[0, :2]).sum().backward()
    if mode == "zero1":  # buckets hold the reduce-scattered gradient: calling the module directly is refused
        with pytest.raises(StrategyError, match="forward did not run before it"):
            model.module(xs[0, :2]).sum().backward()
    return out


@pytest.mark.parametrize("mode", ["zero1", "zero1_all_reduce"])
def test_zero1_gradients_accumulate_like_ddp(mode: str) -> None:
    for res in run_world(2, _zero1, mode, timeout=30):
        (ddp, ddp_norms), (zero1, norms) = res["ddp"], res[mode]
        floats = {k: v for k, v in ddp.items() if v.is_floating_point()}
        assert max_rel_error({k: zero1[k] for k in floats}, floats) <= 1e-5, mode
        assert norms == pytest.approx(ddp_norms, rel=1e-5), mode


def _zero1_grads(backend: CommunicationBackend) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(backend.rank))
    grads = []
    for cls in (DDPModel, ZeRO1Model):
        model = cls(_net(seed=1), backend)
        model(x).pow(2).mean().backward()
        (bucket,) = model.shard_units()  # DDP: param.grad are views into the bucket, in slot order
        if cls is DDPModel:
            grads.append(torch.cat([q.grad.reshape(-1) for q in bucket.params]))
        else:  # ZeRO-1: this rank's averaged slice; param.grad refuses to be read as a whole gradient
            with pytest.raises(StrategyError, match=r"opt\.clip_grad_norm_"):
                bucket.params[0].grad.sum()
            grads.append(model.shard_grad(bucket).clone())
    lo, hi = bucket.shard_bounds()
    return grads, [torch.tensor([lo, hi])], backend.rank


def test_zero1_keeps_the_average_of_its_own_shard() -> None:
    for (ddp, zero1), ((lo, hi),), rank in run_world(4, _zero1_grads, timeout=30):
        n = ddp[lo:hi].numel()  # the last shard ends in padding
        assert torch.allclose(zero1[:n], ddp[lo:hi], rtol=1e-6, atol=1e-7), rank
        assert not zero1[n:].any(), rank


# ---------------------------------------------------------------------------- ZeRO-3 / FSDP options
def _chain() -> nn.Module:
    module = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])  # 1 056 fp32 elements per layer
    return filled(module, 0, scale=0.2)


def _sharded_options(backend: CommunicationBackend, name: str, **kw: Any) -> dict[str, Any]:
    if name == "zero3":
        model: Any = ZeRO3Model(_chain(), backend, **kw)
    else:
        model = FSDPModel(_chain(), backend, wrap_policy=ModuleClassPolicy((nn.Linear,)), **kw)
    opt = optimizer_for(name, model, "sgd")
    for _ in range(2):  # the forward order is recorded in the first step; prefetch uses it from then on
        backend.stats.reset()
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"report": model.memory_report(), "gathers": backend.stats["all_gather"].calls}


def test_zero3_persistence_threshold_and_prefetch() -> None:
    p, layer = 2, 1056 * 4
    runs = {
        "zero3 threshold 0": ("zero3", {"persistence_threshold": 0}),
        "zero3 threshold 32": ("zero3", {"persistence_threshold": 32}),
        "zero3 no prefetch": ("zero3", {"persistence_threshold": 0, "prefetch": False}),
        "fsdp": ("fsdp", {}),
        "fsdp no prefetch": ("fsdp", {"prefetch": False}),
    }
    res = {k: run_world(p, _sharded_options, name, timeout=30, **kw)[0] for k, (name, kw) in runs.items()}
    # threshold 0: every parameter is a shard at rest; 6 units gathered for forward and for backward
    assert res["zero3 threshold 0"]["report"]["parameters"] == 3 * layer // p
    assert res["zero3 threshold 0"]["gathers"] == 12
    # threshold 32: the three biases stay whole (plus their shard for the optimizer) and are all-gathered
    # once after the step; only the weights are gathered for forward and backward
    kept = res["zero3 threshold 32"]
    assert kept["report"]["parameters"] == 3 * layer // p + 3 * 32 * 4
    assert kept["gathers"] == 3 * 2 + 3
    # prefetch: the next layer is gathered while the current one computes, so two layers are whole at the
    # peak; without prefetch one at a time (plus nothing else)
    assert res["zero3 threshold 0"]["report"]["peak_gathered_parameters"] == 2 * layer
    assert res["zero3 no prefetch"]["report"]["peak_gathered_parameters"] == layer
    assert res["fsdp"]["report"]["peak_gathered_parameters"] == 2 * layer
    assert res["fsdp no prefetch"]["report"]["peak_gathered_parameters"] == layer
    assert res["fsdp"]["gathers"] == res["fsdp no prefetch"]["gathers"] == 6  # same traffic, earlier


# ---------------------------------------------------------------------------- reduce dtype
def _wire_bytes(backend: CommunicationBackend, name: str, reduce_dtype: Any) -> tuple[int, str]:
    model = wrap(name, _chain().to(torch.bfloat16), backend, reduce_dtype=reduce_dtype)
    backend.stats.reset()
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    grads = [str(q.grad.dtype) for q in model.module.parameters() if q.grad is not None]
    return backend.stats.bytes_sent, ",".join(sorted(set(grads)))


def test_reduce_dtype_sets_the_dtype_on_the_wire() -> None:
    p, n = 4, 3 * 1056
    for name in ("ddp", "zero1", "zero2"):
        (bf16, _), (fp32, grad_dtype) = (
            run_world(p, _wire_bytes, name, dt, timeout=30)[0] for dt in (None, torch.float32)
        )
        factor = 2 if name == "ddp" else 1  # all-reduce vs reduce-scatter, (P-1)/P of the buffer each
        assert bf16 == factor * (p - 1) * n * 2 // p, name
        assert fp32 == 2 * bf16, name
        if name == "ddp":
            assert grad_dtype == "torch.bfloat16"  # the parameters' gradients keep the parameters' dtype
    with pytest.raises(RankFailedError) as info:
        run_world(1, _wire_bytes, "ddp", torch.int32)
    assert "reduce_dtype must be a floating-point" in str(info.value.__cause__)


# ---------------------------------------------------------------------------- a .grad from before wrapping
def _grad_before_wrapping(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    xs, w, b, stale = (torch.randn(shape, generator=g) for shape in ((2, 4, 5), (2, 5), (2,), (2, 5)))
    out = {}
    for name in ("plain", *STRATEGIES):
        module = nn.Sequential(nn.Linear(5, 2))
        with torch.no_grad():
            module[0].weight.copy_(w)
            module[0].bias.copy_(b)
        module[0].weight.grad = stale.clone()  # a backward on the plain module, no zero_grad since
        if name == "plain":  # kept, it adds into the first step (torch's DDP keeps it in its bucket)
            ocls, kw = OPTIMIZERS["sgd_plain"]
            opt: Any = ocls(module.parameters(), **kw)
            (module(xs[0]).sum() + module(xs[1]).sum()).div(2).backward()
            opt.step()
            out[name] = {k: v.clone() for k, v in module.state_dict().items()}
            continue
        model = wrap(name, module, backend)
        opt = optimizer_for(name, model, "sgd_plain")
        model(xs[backend.rank]).sum().backward()
        opt.step()
        out[name] = model.full_state_dict()
    return out


def test_a_grad_left_from_before_wrapping_adds_into_the_first_step_as_under_torch_ddp() -> None:
    for res in run_world(2, _grad_before_wrapping, timeout=60):
        for name in STRATEGIES:
            assert max_rel_error(res[name], res["plain"]) <= 1e-6, name


# ---------------------------------------------------------------------------- wrapping a module again
def _rewrap(backend: CommunicationBackend) -> dict[str, Any]:
    """Wrap, backward, zero_grad, then wrap the same module again (as the requires_grad error advises):
    the newest wrapper owns the module (DDP, ZeRO-1/2) or the second wrap is refused (ZeRO-3/FSDP)."""
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(2, 4, 5, generator=g)
    values = [torch.randn(shape, generator=g) for shape in ((4, 5), (4,), (2, 4), (2,))]

    def module() -> nn.Module:
        m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        with torch.no_grad():
            for p, v in zip(m.parameters(), values, strict=True):
                p.copy_(v)
        return m

    plain = module()
    ocls, kw = OPTIMIZERS["sgd_plain"]
    plain_opt = ocls(plain.parameters(), **kw)
    (plain(xs[0]).sum() + plain(xs[1]).sum()).div(2).backward()
    plain_opt.step()
    out: dict[str, Any] = {"plain": {k: v.clone() for k, v in plain.state_dict().items()}}
    x = xs[backend.rank]
    for name in STRATEGIES:
        m = module()
        first = wrap(name, m, backend)
        opt1 = optimizer_for(name, first, "sgd_plain")
        before = backend.stats.calls
        first(x).sum().backward()
        one_wrap = backend.stats.calls - before
        opt1.zero_grad()
        res: dict[str, Any] = {"one_wrap": one_wrap}
        try:
            second = wrap(name, m, backend)
        except StrategyError as exc:  # ZeRO-3/FSDP: the module's parameters are the first one's shards
            res["refused"] = str(exc)
            model, opt = first, opt1  # the first wrapper is left working
        else:
            model, opt = second, optimizer_for(name, second, "sgd_plain")
            torch.save(m, io.BytesIO())  # the owner's mark on the parameters does not stop pickling
            calls = {
                "forward": partial(first, x),
                "step": opt1.step,
                "zero_grad": opt1.zero_grad,
                "reduce_accumulated_grads": first.reduce_accumulated_grads,
            }
            for what, call in calls.items():
                try:
                    call()
                except StrategyError as exc:
                    res[f"old_{what}"] = str(exc)
        before = backend.stats.calls
        model(x).sum().backward()
        res["collectives"] = backend.stats.calls - before
        opt.step()
        res["state"] = model.full_state_dict()
        out[name] = res
    return out


def test_a_module_wrapped_again_is_owned_by_the_newest_wrapper_or_refused() -> None:
    for res in run_world(2, _rewrap, timeout=60):
        for name in STRATEGIES:
            r = res[name]
            assert max_rel_error(r["state"], res["plain"]) <= 1e-6, f"{name}: gradients of one wrap"
            assert r["collectives"] == r["one_wrap"] > 0, f"{name}: {r['collectives']} vs {r['one_wrap']}"
            if name in ("zero3", "fsdp"):
                assert "already wrapped" in r.get("refused", ""), name
                assert "full_state_dict()" in r["refused"] and "fresh module" in r["refused"], r["refused"]
                continue
            for what in ("forward", "step", "zero_grad", "reduce_accumulated_grads"):
                msg = r.get(f"old_{what}", "")
                assert "replaced by a newer wrapper of the same module" in msg, f"{name} {what}: {msg!r}"
                assert "use the new one" in msg, msg


# ---------------------------------------------------------------------------- after a refused backward
class _TwoBranches(nn.Module):
    """Two small layers in one gradient bucket; each step uses those it is told (``"a"``, ``"ab"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        return sum((getattr(self, name)(x) for name in use), torch.zeros(()))


def _after_unused_error(backend: CommunicationBackend, name: str) -> dict[str, torch.Tensor]:
    """A synchronized backward using only ``a`` is refused (``b`` got no gradient); the user catches it
    and continues with a step using both, accumulated in ``no_sync()`` and reduced with
    ``reduce_accumulated_grads()``: nothing of the refused step stays (``a``'s gradient from it would
    be added)."""
    with seeded_init(0):
        module = _TwoBranches()
    model = wrap(name, module, backend)
    opt = optimizer_for(name, model, "sgd_plain")
    x = torch.ones(2, 4)
    with pytest.raises(StrategyError, match="find_unused_parameters=True"):
        model(x, "a").sum().backward()
    opt.zero_grad()
    with model.no_sync():
        model(x, "ab").sum().backward()
    model.reduce_accumulated_grads()
    opt.step()
    return model.full_state_dict()


def test_a_step_after_a_refused_backward_equals_plain_training() -> None:
    with seeded_init(0):
        plain = _TwoBranches()
    plain(torch.ones(2, 4), "ab").sum().backward()  # the same on both ranks: their average
    torch.optim.SGD(plain.parameters(), lr=OPTIMIZERS["sgd_plain"][1]["lr"]).step()
    ref = plain.state_dict()
    for name in STRATEGIES:
        for state in run_world(2, _after_unused_error, name, timeout=30):
            assert max_rel_error(state, ref) <= 1e-6, name
