"""Activation checkpointing under ZeRO-3 and FSDP (with their saved-tensor hooks) and DDP: the same
gradients as without, and a lower peak of allocated memory, both measured."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from filled import filled
from steps import plain_steps
from test_strategies_helpers import (
    IN,
    OPTIMIZERS,
    OUT,
    STRATEGIES,
    make_data,
    make_module,
    max_rel_error,
    optimizer_for,
    wrap,
)

from dtlab.backends.base import CommunicationBackend
from dtlab.config import load_config
from dtlab.core import seeded_init
from dtlab.errors import ConfigError, StrategyError
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy, ZeRO3Model
from dtlab.models.checkpointing import checkpoint_modules
from dtlab.testing import run_world
from dtlab.trainers import run_training
from dtlab.trainers.models import Block, TransformerLM
from dtlab.trainers.tasks import cross_entropy_loss


def _model(backend: CommunicationBackend, strategy: str, ckpt: bool) -> Any:
    with seeded_init(0):
        net = TransformerLM(d_model=64, n_layers=3, n_heads=4, seq_len=64)
    if ckpt:
        assert checkpoint_modules(net, (Block,)) == 3
    if strategy == "zero3":
        return ZeRO3Model(net, backend, persistence_threshold=0)
    if strategy == "fsdp":
        return FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)))
    return DDPModel(net, backend)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (16, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model: Any) -> list[torch.Tensor]:
    if hasattr(model, "shard_units"):
        try:
            return [model.shard_grad(u).clone() for u in model.shard_units()]
        except Exception:  # DDP has no shards
            pass
    return [p.grad.clone() for _, p in model.trainable_parameters()]


def _same_grads(backend: CommunicationBackend) -> list[str]:
    done = []
    for strategy in ("zero3", "fsdp", "ddp"):
        grads = []
        for ckpt in (False, True):
            model = _model(backend, strategy, ckpt)
            x, y = _batch(backend.rank)
            cross_entropy_loss(model(x), y).backward()
            grads.append(_grads(model))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        done.append(strategy)
    return done


def test_checkpointing_gives_the_same_gradients_under_zero3_fsdp_and_ddp() -> None:
    assert run_world(2, _same_grads, timeout=120)[0] == ["zero3", "fsdp", "ddp"]


def peak_allocated(fn: Any) -> int:
    """Peak of the CPU allocator's total allocated bytes while ``fn`` runs, above where it started
    (torch.profiler memory events)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    first = totals[0] - next(e["args"]["Bytes"] for e in events if e.get("name") == "[memory]")
    return max(totals) - first


def _peaks(backend: CommunicationBackend) -> dict[str, list[int]]:
    out = {}
    for strategy in ("zero3", "fsdp"):
        peaks = []
        for ckpt in (False, True):
            model = _model(backend, strategy, ckpt)
            x, y = _batch(0)
            peaks.append(peak_allocated(lambda m=model, x=x, y=y: cross_entropy_loss(m(x), y).backward()))
        out[strategy] = peaks
    return out


def test_checkpointing_lowers_peak_memory_under_zero3_and_fsdp() -> None:
    # one rank, so the profiler sees only this rank's allocations (the hooks run as on many ranks)
    for strategy, (plain, ckpt) in run_world(1, _peaks, timeout=120)[0].items():
        assert ckpt < 0.75 * plain, (strategy, plain, ckpt)


def test_trainer_switch_and_its_refusal() -> None:
    base = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
    base += ["model.d_model=32", "model.n_heads=2", "data.max_bytes=40000", "data.global_batch_size=8"]
    base += ["train.steps=3", "train.eval_every=0"]
    runs = [
        run_training(
            load_config(overrides=[*base, "strategy.model=fsdp", f"strategy.activation_checkpointing={c}"])
        )
        for c in ("false", "true")
    ]
    assert [loss for _, loss in runs[0][0].losses] == pytest.approx(
        [loss for _, loss in runs[1][0].losses], rel=1e-6
    )
    digits = ["model.name=digits_cnn", "data.dataset=digits", "strategy.activation_checkpointing=true"]
    with pytest.raises(ConfigError, match="each block of the built-in transformer"):
        load_config(overrides=[*base, *digits])  # before anything is built


class _TorchCheckpoint(torch.nn.Module):
    """The user's own ``torch.utils.checkpoint`` around one layer, reentrant or not."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _checkpointed(where: int, reentrant: bool) -> torch.nn.Module:
    module = make_module()
    module[where] = _TorchCheckpoint(module[where], reentrant)  # type: ignore[index]
    return module


_PLACES = [(where, reentrant) for where in (1, 3) for reentrant in (True, False)]


def _torch_checkpoint_runs(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
    x, y = make_data(3, 8)
    mine = slice(backend.rank * 4, backend.rank * 4 + 4)
    out = {}
    for name in STRATEGIES:
        for where, reentrant in _PLACES:
            small = {"bucket_cap_mb": 1e-4} if name in ("ddp", "zero1", "zero2") else {}  # several buckets
            model = wrap(name, _checkpointed(where, reentrant), backend, **small)
            opt = optimizer_for(name, model, "sgd_plain")
            plain_steps(model, opt, zip(x[:, mine], y[:, mine], strict=True), torch.nn.functional.mse_loss)
            out[f"{name} layer {where} reentrant={reentrant}"] = model.full_state_dict()
    return out


def test_torch_checkpoint_reentrant_or_not_trains_like_plain_under_every_strategy() -> None:
    """A reentrant checkpoint runs its segment's backward as a backward of its own, which ends first: a
    strategy must end its backward with the user's (around the last layer, the first gradients come
    from inside the segment). Before, every strategy but FSDP refused it as unused parameters."""
    x, y = make_data(3, 8)
    want = {}
    for where, reentrant in _PLACES:
        module = _checkpointed(where, reentrant)
        opt = torch.optim.SGD(module.parameters(), **OPTIMIZERS["sgd_plain"][1])
        plain_steps(module, opt, zip(x, y, strict=True), torch.nn.functional.mse_loss)
        want[(where, reentrant)] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for got in run_world(2, _torch_checkpoint_runs, timeout=120):
        for key, state in got.items():
            _, _, where, flag = key.split()
            assert max_rel_error(state, want[(int(where), flag == "reentrant=True")]) < 1e-5, key


def _only_checkpointed_trains() -> torch.nn.Module:
    """Every trainable parameter inside two reentrant checkpoints (layers 1 and 3), the first layer
    frozen and its output made to require grad: Hugging Face's checkpointing on a model trained in part
    (its enable_input_require_grads() hook on a frozen embedding)."""
    module = _checkpointed(1, True)
    module[3] = _TorchCheckpoint(module[3], True)  # type: ignore[index]
    module[0].requires_grad_(False)  # type: ignore[index]
    module[0].register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))  # type: ignore[index]
    return module


def _only_checkpointed_runs(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
    x, y = make_data(3, 8)
    mine = slice(backend.rank * 4, backend.rank * 4 + 4)
    out = {}
    for name in STRATEGIES:
        model = wrap(name, _only_checkpointed_trains(), backend)
        opt = optimizer_for(name, model, "sgd_plain")
        plain_steps(model, opt, zip(x[:, mine], y[:, mine], strict=True), torch.nn.functional.mse_loss)
        out[name] = model.full_state_dict()
    return out


def test_every_trainable_parameter_in_reentrant_checkpoints_trains_like_plain() -> None:
    """The user's backward then accumulates no .grad itself: each segment's nested backward does, and
    the first of them ends first. DDP and ZeRO-1/2 took the user's pass for a torch.autograd.grad one
    and ended theirs with the first segment's (refused: parameters received no gradient)."""
    x, y = make_data(3, 8)
    module = _only_checkpointed_trains()
    opt = torch.optim.SGD(module.parameters(), **OPTIMIZERS["sgd_plain"][1])
    plain_steps(module, opt, zip(x, y, strict=True), torch.nn.functional.mse_loss)
    want = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert (want["1.inner.fc.weight"] - make_module().state_dict()["1.fc.weight"]).abs().max() > 1e-2
    for got in run_world(2, _only_checkpointed_runs, timeout=120):
        for name, state in got.items():
            assert max_rel_error(state, want) < 1e-5, name


class _UsedTwice(torch.nn.Module):
    """One layer used before and inside the user's checkpoint: under a reentrant one its gradient
    arrives twice in one backward (once from the checkpoint's own backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.c = torch.nn.Linear(IN, IN), torch.nn.Linear(IN, OUT)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        inner = torch.utils.checkpoint.checkpoint(self.a, h, use_reentrant=self.reentrant)
        return self.c(torch.tanh(inner))


def _used_twice(reentrant: bool) -> torch.nn.Module:
    module = _UsedTwice(reentrant)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return module


def _used_twice_runs(backend: CommunicationBackend) -> dict[str, Any]:
    x, y = make_data(2, 8)
    mine = slice(backend.rank * 4, backend.rank * 4 + 4)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for reentrant in (False, True):
            model = wrap(name, _used_twice(reentrant), backend)
            opt = optimizer_for(name, model, "sgd_plain")
            try:
                plain_steps(
                    model, opt, zip(x[:, mine], y[:, mine], strict=True), torch.nn.functional.mse_loss
                )
                out[f"{name} {reentrant}"] = model.full_state_dict()
            except (StrategyError, RuntimeError) as exc:  # FSDP + reentrant: torch's error in backward
                out[f"{name} {reentrant}"] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_parameter_used_inside_and_outside_a_reentrant_checkpoint() -> None:
    """Non-reentrant: every strategy trains like one process. Reentrant: the parameter's gradient comes
    twice in one backward; DDP and ZeRO-1/2 average buckets in place, so they refuse it naming the fix
    (before: silently off by ~0.07, DDP's replicas apart); ZeRO-3 reduces a late gradient again, so it
    stays exact. FSDP fails inside autograd there (a documented limit), never silently."""
    x, y = make_data(2, 8)
    want = {}
    for reentrant in (False, True):
        module = _used_twice(reentrant)
        opt = torch.optim.SGD(module.parameters(), **OPTIMIZERS["sgd_plain"][1])
        plain_steps(module, opt, zip(x, y, strict=True), torch.nn.functional.mse_loss)
        want[reentrant] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for got in run_world(2, _used_twice_runs, timeout=120):
        for name in STRATEGIES:
            assert max_rel_error(got[f"{name} False"], want[False]) < 1e-5, name
        for name in ("ddp", "zero1", "zero2"):
            assert "received its gradient twice" in got[f"{name} True"], name
            assert "use_reentrant=False" in got[f"{name} True"]
        assert max_rel_error(got["zero3 True"], want[True]) < 1e-5
        assert isinstance(got["fsdp True"], str), "FSDP fails loudly there (a limit), never silently"


class _Counted(torch.nn.Linear):
    """Counts its forwards (a checkpoint's backward runs it again)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def _counted() -> torch.nn.Module:
    return filled(
        torch.nn.Sequential(_Counted(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, OUT)), 0, scale=0.4
    )


def _around_runs(backend: CommunicationBackend) -> dict[str, Any]:
    """A non-reentrant checkpoint and counting saved-tensor hooks around the whole model."""
    torch.set_num_threads(1)
    x, y = make_data(3, 8)
    mine = slice(backend.rank * 4, backend.rank * 4 + 4)
    loss = torch.nn.functional.mse_loss
    out: dict[str, Any] = {}
    for name in ("zero3", "fsdp", "ddp"):
        kw: dict[str, Any] = {
            "zero3": {"persistence_threshold": 0},
            "fsdp": {"wrap_policy": ModuleClassPolicy((torch.nn.Linear,))},
        }.get(name, {})
        net = _counted()
        model = wrap(name, net, backend, **kw)
        opt = optimizer_for(name, model, "adamw")
        for s in range(3):
            out_ = torch.utils.checkpoint.checkpoint(model, x[s, mine], use_reentrant=False)
            loss(out_, y[s, mine]).backward()
            opt.step()
            opt.zero_grad()
        calls, packed = net[0].calls, []
        with torch.autograd.graph.saved_tensors_hooks(packed.append, lambda t: t):  # returns None: unused
            model(x[0, mine])
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        activations = sum(t.untyped_storage().data_ptr() not in params for t in packed)
        out[name] = (calls, model.full_state_dict(), activations, len(packed))
    return out


def test_a_checkpoint_or_hooks_around_a_zero3_fsdp_model_get_its_activations() -> None:
    """ZeRO-3's and FSDP's saved-tensor hooks used to keep every activation themselves, shadowing the
    user's: a checkpoint around the model recomputed nothing (its forward ran once per step) and
    ``save_on_cpu()`` offloaded nothing (the hooks saw no tensor of the model's forward)."""
    x, y = make_data(3, 8)
    module = _counted()
    opt = torch.optim.AdamW(module.parameters(), **OPTIMIZERS["adamw"][1])
    plain_steps(module, opt, zip(x, y, strict=True), torch.nn.functional.mse_loss)
    want = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for rank, got in enumerate(run_world(2, _around_runs, timeout=60)):
        ddp_calls, _, ddp_activations, _ = got["ddp"]
        assert ddp_calls == 6 and ddp_activations > 0, got["ddp"][::2]
        for name, (calls, state, activations, packed) in got.items():
            assert calls == ddp_calls, (name, rank, calls)  # each step's forward recomputed
            assert max_rel_error(state, want) < 1e-5, (name, rank)
            assert activations == ddp_activations, (name, rank, activations, packed)  # no parameter copies


def test_checkpointed_modules_under_torch_compile_equal_eager() -> None:
    """``torch.compile`` of a model with checkpointed modules stopped inside dynamo ('context_fn arg
    passed to torch.utils.checkpoint must generate a tuple of two TorchDispatchModes'): the checkpoint
    now runs eagerly there (a graph break per checkpointed module), with the same gradients and
    BatchNorm statistics as the model without checkpoints."""

    def make() -> torch.nn.Module:
        with seeded_init(0):
            layers = [torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)]
            return torch.nn.Sequential(*layers)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    plain, checkpointed = make(), make()
    assert checkpoint_modules(checkpointed, (torch.nn.BatchNorm1d, torch.nn.Linear)) == 3
    for model in (plain, torch.compile(checkpointed)):
        torch.nn.functional.mse_loss(model(x), y).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[name], value, rtol=1e-6, atol=1e-7, msg=name)
