"""Memory (exact), bytes (cost model), no_sync accumulation, resharding and cross-strategy checkpoints,
unused parameters, clipping, the swappable reducer and bad input of the data-parallel strategies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from filled import filled
from test_strategies_helpers import (
    IN,
    OPTIMIZERS,
    STRATEGIES,
    make_data,
    make_module,
    max_rel_error,
    optimizer_for,
    train_reference,
    wrap,
)
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import CheckpointError, RankFailedError, StrategyError
from dtlab.models import (
    DDPModel,
    DenseReducer,
    FSDPModel,
    ModuleClassPolicy,
    ShardedState,
    SizePolicy,
    ZeRO2Model,
    ZeRO3Model,
    get_model_strategy,
)
from dtlab.optimizers import (
    DDPOptimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
    default_optimizer_strategy,
    get_optimizer_strategy,
)
from dtlab.testing import run_world


def _mlp(seed: int = 0) -> nn.Module:
    return filled(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)), seed, scale=0.2)


# ---------------------------------------------------------------------------- memory and bytes
def _one_step_report(backend: CommunicationBackend, name: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"wrap_policy": ModuleClassPolicy((nn.Linear,))} if name == "fsdp" else {}
    model = wrap(name, _mlp(), backend, **kw)
    no_optimizer = model.memory_report()["optimizer_state"]
    opt = optimizer_for(name, model, "adamw")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(backend.rank))
    backend.stats.reset()
    model(x).pow(2).mean().backward()
    opt.step()
    sent = backend.stats.bytes_sent
    kinds = backend.stats.snapshot()
    opt.zero_grad()
    units = [u.numel for u in model.shard_units()]
    pieces = [b - a for u in model.shard_units() for _, a, b, _ in u.shard_slots()]
    out = {"report": opt.memory_report(), "sent": sent, "kinds": kinds, "units": units, "pieces": pieces}
    return out | {"no_optimizer": no_optimizer}


def test_memory_exact_and_bytes_match_cost_model() -> None:
    p = 4
    res = {name: run_world(p, _one_step_report, name, timeout=30)[1] for name in STRATEGIES}
    n = sum(q.numel() for q in _mlp().parameters())  # 4192 fp32 elements
    grad_bytes, es = 4 * n, 4
    ddp = res["ddp"]["report"]
    for name in STRATEGIES:  # the four keys, plus buffers (docs/architecture.md, "Model strategies")
        keys = {"parameters", "gradients", "optimizer_state", "peak_gathered_parameters", "buffers"}
        assert set(res[name]["report"]) == keys, name
        assert res[name]["no_optimizer"] == 0, name  # before an optimizer strategy is attached
    # DDP holds everything whole (buckets padded to a multiple of P: here no padding is needed)
    assert ddp["parameters"] == ddp["gradients"] == ddp["peak_gathered_parameters"] == grad_bytes
    assert ddp["optimizer_state"] == 2 * grad_bytes + 4 * 4  # exp_avg + exp_avg_sq + a step per param
    for name in ("zero1", "zero2", "zero3", "fsdp"):
        rep, units = res[name]["report"], res[name]["units"]
        shard_elems = sum(-(-u // p) for u in units)
        padding = shard_elems * p - n
        assert 0 <= padding < p * len(units), f"{name}: padding {padding}"
        # optimizer state: exactly this rank's pieces of both moments (padding excluded) + one step
        # count per piece (each piece of a parameter is one tensor of the local optimizer)
        pieces = res[name]["pieces"]
        assert rep["optimizer_state"] == 2 * es * sum(pieces) + 4 * len(pieces), name
        assert 2 * es * shard_elems - (ddp["optimizer_state"] - 16) / p <= 2 * es * padding / p + 2 * es, name
        if name != "zero1":  # ZeRO-1 keeps whole gradients by design
            assert rep["gradients"] == es * shard_elems, name
        else:
            assert rep["gradients"] == ddp["gradients"]
        if name in ("zero3", "fsdp"):  # resting parameters: the shards only
            assert rep["parameters"] == es * shard_elems, name
            assert rep["peak_gathered_parameters"] > 0
            assert rep["peak_gathered_parameters"] <= grad_bytes + es * padding
        else:
            assert rep["parameters"] == ddp["parameters"]
    # bytes sent per rank in one step against the ring cost model
    cost = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}
    for name, factor in cost.items():
        expected = factor * (p - 1) / p * grad_bytes
        sent = res[name]["sent"]
        assert abs(sent - expected) <= 0.05 * expected, f"{name}: sent {sent}, cost model {expected:.0f}"
    assert set(res["ddp"]["kinds"]) == {"all_reduce"}
    assert set(res["zero1"]["kinds"]) == {"reduce_scatter", "all_gather"}  # DeepSpeed's ZeRO-1 traffic
    assert set(res["zero2"]["kinds"]) == {"reduce_scatter", "all_gather"}
    assert set(res["fsdp"]["kinds"]) == {"reduce_scatter", "all_gather"}
    # FSDP: one all-gather per unit forward and backward, one reduce-scatter per unit
    assert res["fsdp"]["kinds"]["all_gather"]["calls"] == 4
    assert res["fsdp"]["kinds"]["reduce_scatter"]["calls"] == 2


# ---------------------------------------------------------------------------- accumulation
def _accumulate(backend: CommunicationBackend, name: str) -> tuple[dict[str, torch.Tensor], int]:
    x, y = make_data(1, 16)
    model = wrap(name, make_module(), backend)
    opt = optimizer_for(name, model, "adamw")
    p, r = backend.world_size, backend.rank
    local = 16 // p
    micro = [
        (x[0, r * local : r * local + local // 2], y[0, r * local : r * local + local // 2]),
        (x[0, r * local + local // 2 : (r + 1) * local], y[0, r * local + local // 2 : (r + 1) * local]),
    ]
    with model.no_sync():
        before = backend.stats.bytes_sent
        (nn.functional.mse_loss(model(micro[0][0]), micro[0][1]) / 2).backward()
        sent_in_no_sync = backend.stats.bytes_sent - before
    (nn.functional.mse_loss(model(micro[1][0]), micro[1][1]) / 2).backward()
    opt.step()
    return model.full_state_dict(), sent_in_no_sync


def test_no_sync_accumulation_equals_one_large_batch() -> None:
    ref = train_reference("adamw", 1, 16)
    for name in STRATEGIES:
        for state, gradient_bytes in run_world(2, _accumulate, name, timeout=30):
            assert max_rel_error(state, ref) <= 1e-5, name
            if name in ("ddp", "zero1", "zero2"):
                assert gradient_bytes == 0, f"{name} communicated {gradient_bytes} bytes inside no_sync()"


def _reduce_inside_no_sync(backend: CommunicationBackend, name: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Both micro-batches' backward inside ``no_sync()``, then ``reduce_accumulated_grads()`` called
    still inside it: the same step as a synchronized accumulation, and ``param.grad`` refuses reads
    where the reduced gradient stays sharded, as after a synchronized backward."""
    x, y = make_data(1, 16)
    model = wrap(name, make_module(), backend)
    opt = optimizer_for(name, model, "adamw")
    r, local = backend.rank, 16 // backend.world_size
    with model.no_sync():
        for half in range(2):
            lo = r * local + half * local // 2
            xs, ys = x[0, lo : lo + local // 2], y[0, lo : lo + local // 2]
            (nn.functional.mse_loss(model(xs), ys) / 2).backward()
        model.reduce_accumulated_grads()
    refused = []
    for q in model.module.parameters():
        try:
            q.grad.sum()
        except StrategyError:
            refused.append(q)
    opt.step()
    return model.full_state_dict(), len(refused) == len(list(model.module.parameters()))


def test_reduce_accumulated_grads_inside_no_sync_reduces_them() -> None:
    ref = train_reference("adamw", 1, 16)
    for name in STRATEGIES:
        for state, guarded in run_world(2, _reduce_inside_no_sync, name, timeout=30):
            assert max_rel_error(state, ref) <= 1e-5, name
            assert guarded == (name != "ddp"), name


# ---------------------------------------------------------------------------- checkpoints
def _train_steps(
    backend: CommunicationBackend, name: str, first: int, last: int, load: Any = None, **kw: Any
) -> tuple[dict[str, torch.Tensor], ShardedState, ShardedState]:
    steps, gb = 3, 8
    x, y = make_data(steps, gb)
    model = wrap(name, make_module(seed=7 if load else 0), backend, **kw)
    opt = optimizer_for(name, model, "adamw")
    if load is not None:
        model.load_sharded_state_dict(load[0])
        opt.load_sharded_state_dict(load[1])
    p, r = backend.world_size, backend.rank
    local = gb // p
    for s in range(first, last):
        nn.functional.mse_loss(
            model(x[s, r * local : (r + 1) * local]), y[s, r * local : (r + 1) * local]
        ).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict(), model.sharded_state_dict(), opt.sharded_state_dict()


def test_reshard_4_to_2_and_across_strategies_resumes_training_exactly() -> None:
    ref3 = train_reference("adamw", 3, 8)
    for saver, loader in [("zero3", "zero3"), ("fsdp", "ddp"), ("ddp", "fsdp"), ("zero1", "zero2")]:
        saved = run_world(4, _train_steps, saver, 0, 2, timeout=30)
        model_shards = [s[1] for s in saved]
        opt_shards = [s[2] for s in saved]
        assert {s.metadata["strategy"] for s in model_shards} == {saver}
        assert [s.metadata["rank"] for s in model_shards] == [0, 1, 2, 3]
        # loading at 2 ranks under another strategy gives the same full state ...
        loaded = run_world(2, _train_steps, loader, 0, 0, (model_shards, opt_shards), timeout=30)
        for full, _, _ in loaded:
            assert max_rel_error(full, saved[0][0]) == 0.0, f"{saver} -> {loader}"
        # ... and the third step (optimizer state resharded too) matches uninterrupted training
        resumed = run_world(2, _train_steps, loader, 2, 3, (model_shards, opt_shards), timeout=30)
        for full, _, _ in resumed:
            assert max_rel_error(full, ref3) <= 1e-5, f"{saver} (4 ranks) -> {loader} (2 ranks)"


def _load_partial(backend: CommunicationBackend, shards: list[ShardedState]) -> None:
    ZeRO3Model(make_module(), backend, persistence_threshold=0).load_sharded_state_dict(shards)


def test_checkpoint_with_missing_ranks_is_an_error() -> None:
    saved = run_world(2, _train_steps, "fsdp", 0, 1, timeout=30)
    with pytest.raises(RankFailedError) as info:
        run_world(1, _load_partial, [saved[0][1]])
    assert isinstance(info.value.__cause__, CheckpointError)
    assert "pass the shards of every saved rank" in str(info.value.__cause__)


# ---------------------------------------------------------------------------- unused parameters
class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused(backend: CommunicationBackend, name: str, find: bool) -> dict[str, torch.Tensor]:
    with seeded_init(0):  # never torch.manual_seed inside a rank: in-memory ranks share the RNG
        module = WithUnused()
    model = wrap(name, module, backend, find_unused_parameters=find)
    opt = optimizer_for(name, model, "sgd")
    before = model.full_state_dict()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    after = model.full_state_dict()
    assert torch.equal(before["unused.weight"], after["unused.weight"])
    assert not torch.equal(before["used.weight"], after["used.weight"])
    return after


@pytest.mark.parametrize("name", STRATEGIES)
def test_unused_parameters_are_named_or_skipped_on_request(name: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(2, _unused, name, False, timeout=10)
    msg = str(info.value.__cause__)
    assert isinstance(info.value.__cause__, StrategyError)
    assert "unused.weight" in msg and "unused.bias" in msg and "find_unused_parameters=True" in msg
    run_world(2, _unused, name, True, timeout=10)


# ---------------------------------------------------------------------------- clipping, reducer, dtypes
class CountingReducer(DenseReducer):
    def __init__(self, backend: CommunicationBackend) -> None:
        super().__init__(backend)
        self.calls: list[tuple[str, str]] = []

    def all_reduce(self, key: str, grad: torch.Tensor) -> Any:
        self.calls.append(("all_reduce", key))
        return super().all_reduce(key, grad)

    def reduce_scatter(self, key: str, grad: torch.Tensor, shard: torch.Tensor) -> Any:
        self.calls.append(("reduce_scatter", key))
        return super().reduce_scatter(key, grad, shard)


def _clip_and_reducer(backend: CommunicationBackend, name: str) -> tuple[Any, ...]:
    x, y = make_data(2, 8)
    model = wrap(name, make_module(), backend)
    reducer = CountingReducer(model.dp_backend)
    model.gradient_reducer = reducer
    opt = optimizer_for(name, model, "sgd")
    p, r = backend.world_size, backend.rank
    norms, keys = [], []
    for s in range(2):
        reducer.calls.clear()
        loss = nn.functional.mse_loss(
            model(x[s, r * 8 // p : (r + 1) * 8 // p]), y[s, r * 8 // p : (r + 1) * 8 // p]
        )
        loss.backward()
        assert opt.grads_are_finite()
        norms.append(float(opt.clip_grad_norm_(0.05)))
        keys.append(list(reducer.calls))
        opt.step()
        opt.zero_grad()
    return model.full_state_dict(), norms, keys


def test_global_norm_clipping_and_swapped_reducer() -> None:
    x, y = make_data(2, 8)
    module = make_module()
    ref_opt = torch.optim.SGD(module.parameters(), **OPTIMIZERS["sgd"][1])
    ref_norms = []
    for s in range(2):
        nn.functional.mse_loss(module(x[s]), y[s]).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), 0.05)))
        ref_opt.step()
        ref_opt.zero_grad()
    ref = {k: v.detach() for k, v in module.state_dict().items()}
    for name in STRATEGIES:
        for state, norms, keys in run_world(2, _clip_and_reducer, name, timeout=30):
            assert max_rel_error(state, ref) <= 1e-5, name
            assert norms == pytest.approx(ref_norms, rel=1e-5), name
            kind = "all_reduce" if name == "ddp" else "reduce_scatter"
            assert keys[0] and keys[0] == keys[1], f"{name}: reducer keys must be stable across steps"
            assert {k for k, _ in keys[0]} == {kind}, name


def _bf16(backend: CommunicationBackend, name: str) -> list[float]:
    with seeded_init(0):
        module = make_module()
    model = wrap(name, module.to(torch.bfloat16), backend, reduce_dtype=torch.float32)
    opt = optimizer_for(name, model, "adamw")
    x, y = make_data(6, 8)
    losses = []
    for _ in range(6):
        loss = nn.functional.mse_loss(model(x[0].to(torch.bfloat16)), y[0].to(torch.bfloat16))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_parameters_with_fp32_reduction_train() -> None:
    for name in ("ddp", "zero2", "fsdp"):
        losses = run_world(2, _bf16, name, timeout=30)[0]
        assert losses[-1] < losses[0], f"{name}: {losses}"


# ---------------------------------------------------------------------------- bad input
def _errors(backend: CommunicationBackend) -> None:
    with pytest.raises(StrategyError, match=r"ZeRO3Optimizer cannot drive a DDPModel.*Use DDPOptimizer"):
        ZeRO3Optimizer(DDPModel(make_module(), backend), torch.optim.SGD, lr=0.1)
    with pytest.raises(StrategyError, match=r"DDPOptimizer cannot drive a FSDPModel.*ZeRO3Optimizer"):
        DDPOptimizer(FSDPModel(make_module(), backend), torch.optim.SGD, lr=0.1)
    with pytest.raises(StrategyError, match="has no parameters"):
        DDPModel(nn.ReLU(), backend)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(StrategyError, match="mixed devices"):
        ZeRO2Model(mixed, backend)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(StrategyError, match="requires_grad=False"):
        FSDPModel(frozen, backend)
    model = ZeRO2Model(make_module(), backend)
    opt = ZeRO2Optimizer(model, torch.optim.AdamW, lr=0.1)
    with pytest.raises(StrategyError, match=r"step\(\) found no synchronized gradients"):
        opt.step()
    model(torch.ones(2, IN)).sum().backward()
    opt.zero_grad()  # the synchronized gradients are dropped: nothing to step on
    with pytest.raises(StrategyError, match=r"step\(\) found no synchronized gradients"):
        opt.step()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer class"):
        ZeRO2Optimizer(ZeRO2Model(make_module(), backend), "adam")  # type: ignore[arg-type]
    with pytest.raises(StrategyError, match="already has an optimizer strategy"):
        ZeRO2Optimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="wrap_policy"):
        FSDPModel(make_module(), backend, wrap_policy=nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_num_params"):
        SizePolicy(0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDPModel(make_module(), backend, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"reshard_after_forward=False is FSDPModel's option.*use FSDPModel"):
        ZeRO3Model(make_module(), backend, reshard_after_forward=False)  # type: ignore[call-arg]
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    with pytest.raises(StrategyError, match="shared by units"):
        FSDPModel(tied, backend, wrap_policy=ModuleClassPolicy((nn.Linear,)))
    with pytest.raises(TypeError, match="list of every saved rank"):
        model.load_sharded_state_dict(model.sharded_state_dict())  # type: ignore[arg-type]
    for name in STRATEGIES:  # a unit of another model (an optimizer built on another wrapper)
        other, mine = wrap(name, make_module(), backend), wrap(name, make_module(), backend)
        for read in (mine.shard_param, mine.shard_grad):
            with pytest.raises(ValueError, match="does not belong to this model"):
                read(other.shard_units()[0])


def test_bad_input_errors() -> None:
    run_world(1, _errors)
    with pytest.raises(ValueError, match="ddp, zero1, zero2, zero3, fsdp"):
        get_model_strategy("zero4")
    with pytest.raises(ValueError, match="ddp, zero1, zero2, zero3"):
        get_optimizer_strategy("lamb")
    assert default_optimizer_strategy("fsdp") is ZeRO3Optimizer
    assert get_model_strategy("FSDP") is FSDPModel
