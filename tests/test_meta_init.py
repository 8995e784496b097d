"""ZeRO-3 and FSDP built from a module on the meta device: each rank materializes only its shards,
the values are bitwise those of the module built plainly under ``seeded_init(init_seed)`` and wrapped
(tied weights, frozen parameters, buffers kept from construction or reset by ``reset_parameters()``),
the parameter bytes held equal the plainly wrapped model's share, training matches single-process
training, and a tensor nothing initializes is a named error in the constructor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from steps import plain_steps
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy, ZeRO3Model
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.testing import run_world


class _Rotary(nn.Module):
    """A buffer computed in ``__init__`` on the CPU even under ``torch.device('meta')`` (kept from
    construction), a Linear, and a BatchNorm whose running statistics are on meta (reset by its
    ``reset_parameters()``)."""

    def __init__(self, dim: int = 8, buffer_device: str | None = "cpu") -> None:
        super().__init__()
        freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=buffer_device).float() / dim))
        self.register_buffer("inv_freq", freq, persistent=False)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.inv_freq.repeat(2)


def _net() -> nn.Module:
    net = nn.Sequential(
        nn.Embedding(11, 8), nn.Linear(8, 24), nn.LayerNorm(24), nn.Linear(24, 8), _Rotary(), nn.Linear(8, 11)
    )
    net[5].weight = net[0].weight  # tied after construction, as language models do
    net[3].bias.requires_grad_(False)  # frozen: kept whole on every rank
    return net


_WRAPS: dict[str, tuple[type, dict[str, Any]]] = {
    "zero3/0": (ZeRO3Model, {"persistence_threshold": 0}),
    "zero3/30": (ZeRO3Model, {"persistence_threshold": 30}),  # small ones whole, large ones sharded
    "fsdp/root": (FSDPModel, {}),
    "fsdp/linear": (FSDPModel, {"wrap_policy": ModuleClassPolicy((nn.LayerNorm, _Rotary))}),
}


def _tokens(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (steps, batch), generator=g), torch.randn(steps, batch, 11, generator=g)


def _train(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, lo: int, hi: int) -> list[float]:
    return plain_steps(model, opt, zip(x[:, lo:hi], y[:, lo:hi], strict=True), nn.functional.mse_loss)


def _built_both_ways(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    p, r = backend.world_size, backend.rank
    x, y = _tokens(3, 8)
    for name, (cls, kw) in _WRAPS.items():
        with seeded_init(5):
            plain_net = _net()
        plain = cls(plain_net, backend, **kw)
        with torch.device("meta"):
            net = _net()
        meta = cls(net, backend, init_seed=5, **kw)
        a, b = plain.full_state_dict(), meta.full_state_dict()
        out[f"{name}/keys"] = sorted(a) == sorted(b)
        out[f"{name}/differ"] = sorted(k for k in a if not torch.equal(a[k], b[k]))
        out[f"{name}/bytes"] = (plain.memory_report()["parameters"], meta.memory_report()["parameters"])
        out[f"{name}/meta_left"] = [
            n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta
        ]
        out[f"{name}/tied"] = net[5].weight is net[0].weight
        opt = ZeRO3Optimizer(meta, torch.optim.SGD, lr=0.1)
        meta.eval()  # BatchNorm on its running statistics: per-rank batch statistics differ
        out[f"{name}/losses"] = _train(meta, opt, x, y, r * 8 // p, (r + 1) * 8 // p)
        out[f"{name}/trained"] = meta.full_state_dict()
    return out


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    with seeded_init(5):
        net = _net()
    net.eval()
    x, y = _tokens(3, 8)
    opt = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=0.1)
    return _train(net, opt, x, y, 0, 8), {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("world", [2, 4])
def test_meta_construction_is_bitwise_the_plain_build_and_holds_only_the_share(world: int) -> None:
    results = run_world(world, _built_both_ways)
    ref_losses, ref_state = _reference()
    for name in _WRAPS:
        for rank, res in enumerate(results):
            where = f"{name} rank {rank}/{world}"
            assert res[f"{name}/keys"], where
            assert res[f"{name}/differ"] == [], where  # parameters, inv_freq, BatchNorm statistics
            plain_bytes, meta_bytes = res[f"{name}/bytes"]
            assert meta_bytes == plain_bytes, where
            assert res[f"{name}/meta_left"] == [], where
            assert res[f"{name}/tied"], where
        mean_losses = [
            sum(step) / world for step in zip(*(res[f"{name}/losses"] for res in results), strict=True)
        ]
        # equal local batches: the mean of the ranks' losses is the global batch's loss
        assert mean_losses == pytest.approx(ref_losses, rel=1e-5), name
        for res in results:
            for k, v in ref_state.items():
                torch.testing.assert_close(res[f"{name}/trained"][k], v, rtol=1e-5, atol=1e-6)


def test_meta_construction_holds_exactly_the_share() -> None:
    """Exact bytes: ZeRO-3 with every parameter sharded holds ceil(n/P) elements per trainable
    parameter plus the frozen ones whole, nothing else (no whole copy left; the sharded parameters
    parked at their logical shape over one shared element)."""

    def held(backend: CommunicationBackend) -> tuple[int, int]:
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(10, 30), nn.Linear(30, 7), nn.Linear(7, 3))
        net[1].bias.requires_grad_(False)
        model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=1)
        parked = [t.numel() > 1 and all(st == 0 for st in t.stride()) for t in net.parameters()]
        assert sum(parked) == 5  # the sharded ones: logical shape over one shared element, no storage
        kept = sum(
            t.numel() * t.element_size() for t, p in zip(net.parameters(), parked, strict=True) if not p
        )
        return model.memory_report()["parameters"], kept

    for world in (2, 4):
        shapes = [300, 30, 210, 21, 3]
        expected = sum(-(-n // world) for n in shapes) * 4 + 7 * 4
        for got, kept_whole in run_world(world, held):
            assert got == expected, world
            assert kept_whole == 7 * 4, world  # the frozen bias whole; the rest parked between uses


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _HalfReset(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # forgets the bias


def _error(make: Callable[[], nn.Module], **kw: Any) -> str:
    def body(backend: CommunicationBackend) -> None:
        with torch.device("meta"):
            net = make()
        FSDPModel(net, backend, **kw)

    with pytest.raises(Exception) as info:  # the message is checked below
        run_world(2, body)
    return str(info.value)


def test_tensors_nothing_initializes_are_named() -> None:
    msg = _error(lambda: nn.Sequential(nn.Linear(3, 3), _NoReset()), init_seed=0)
    assert "'1.scale'" in msg and "_NoReset" in msg and "param_init_fn" in msg
    msg = _error(lambda: nn.Sequential(_HalfReset(3, 3)), init_seed=0)
    assert "parameter 'bias'" in msg and "'0'" in msg and "uninitialized" in msg
    msg = _error(lambda: nn.Sequential(_Rotary(buffer_device=None)), init_seed=0)  # inv_freq on meta
    assert "'0.inv_freq'" in msg and "_Rotary" in msg and "buffers on the real device" in msg
    msg = _error(lambda: nn.Linear(3, 3))
    assert "init_seed=<int>" in msg and "meta device" in msg
    msg = _error(lambda: nn.Linear(3, 3), init_seed="0")
    assert "init_seed must be an int" in msg

    def materialized(backend: CommunicationBackend) -> None:
        FSDPModel(nn.Linear(3, 3), backend, init_seed=0)

    with pytest.raises(Exception, match=r"already on cpu.*drop init_seed"):
        run_world(2, materialized)

    def replicated(backend: CommunicationBackend) -> None:
        with torch.device("meta"):
            net = nn.Linear(3, 3)
        DDPModel(net, backend)

    with pytest.raises(Exception, match=r"DDPModel: .* meta device.*ZeRO3Model/FSDPModel with init_seed"):
        run_world(2, replicated)


def test_param_init_fn_replaces_reset_parameters() -> None:
    def init(module: nn.Module) -> None:
        for q in module.parameters(recurse=False):
            nn.init.constant_(q, 0.5)
        if isinstance(module, _Rotary):
            module.inv_freq.copy_(torch.arange(4.0))
        if isinstance(module, nn.BatchNorm1d):
            module.reset_running_stats()

    def body(backend: CommunicationBackend) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        with torch.device("meta"):
            net = nn.Sequential(_NoReset(), _Rotary(buffer_device=None))
        state = FSDPModel(net, backend, init_seed=0, param_init_fn=init).full_state_dict()
        return state, net[1].inv_freq.clone()

    for state, inv_freq in run_world(2, body):
        assert torch.equal(state["0.scale"], torch.full((3,), 0.5))
        assert torch.equal(state["1.proj.weight"], torch.full((8, 8), 0.5))
        assert torch.equal(state["1.norm.running_var"], torch.ones(8))
        assert torch.equal(inv_freq, torch.arange(4.0))


def test_transformer_lm_on_meta_initializes_itself() -> None:
    """dtlab's TransformerLM draws its values in its layers' reset_parameters(): built on meta with
    init_seed alone it has its own distributions (std 0.02, zero biases, LayerNorm ones), equal to the
    plain build, and its first loss is log(256)."""
    from dtlab.zoo.builtin import Block, TransformerLM

    def body(backend: CommunicationBackend) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
        with torch.device("meta"):
            net = TransformerLM(d_model=32, n_layers=2, n_heads=2, seq_len=8)
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)), init_seed=0)
        with seeded_init(0):
            plain = TransformerLM(d_model=32, n_layers=2, n_heads=2, seq_len=8)
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(backend.rank))
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        return model.full_state_dict(), plain.state_dict(), loss.item()

    for state, plain, loss in run_world(2, body):
        assert all(torch.equal(state[k], v) for k, v in plain.items())
        assert 0.018 < float(state["tok.weight"].std()) < 0.022
        assert 0.018 < float(state["blocks.1.mlp.0.weight"].std()) < 0.022
        assert torch.equal(state["blocks.0.attn.qkv.bias"], torch.zeros(96))
        assert torch.equal(state["blocks.0.ln1.weight"], torch.ones(32))
        assert abs(loss - 5.545) < 0.05  # log(256): near-uniform logits from the small init
