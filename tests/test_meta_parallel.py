"""Meta-device construction under tensor, pipeline and hybrid parallelism (and ZeRO-3/FSDP per block)
on dtlab's TransformerLM: every rank's tensors are bitwise those of the model built plainly under
``seeded_init(init_seed)`` and wrapped the same way, and two SGD steps give bitwise the same losses and
parameters."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import (
    FSDPModel,
    HybridShardedModel,
    ModuleClassPolicy,
    PipelineParallelModel,
    TensorParallelModel,
    ZeRO3Model,
    init_empty_weights,
    transformer_plan,
)
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world
from dtlab.zoo.builtin import Block, TransformerLM

SEED = 7


def _lm() -> TransformerLM:
    return TransformerLM(d_model=16, n_layers=2, n_heads=2, seq_len=8)


def _wrap(case: str, net: nn.Module, backend: CommunicationBackend, **kw: Any) -> Any:
    if case == "zero3":
        return ZeRO3Model(net, backend, persistence_threshold=0, **kw)
    if case == "fsdp/block":
        return FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)), **kw)
    if case == "tp2":
        return TensorParallelModel(net, backend, plan=transformer_plan(), **kw)
    if case == "pp2":
        return PipelineParallelModel(net, backend, micro_batches=2, **kw)
    mesh = Mesh(backend, {"pp": 2, "dp": 2, "tp": 2})
    policy = ModuleClassPolicy((Block,))
    return HybridShardedModel(
        net, mesh, "fsdp", tensor_plan=transformer_plan(), micro_batches=2, wrap_policy=policy, **kw
    )


_WORLD = {"zero3": 2, "fsdp/block": 2, "tp2": 2, "pp2": 2, "dp2xtp2xpp2": 8}


def _local(model: Any) -> dict[str, torch.Tensor]:
    """This rank's own tensors (its shards), by name."""
    state = model.sharded_state_dict()
    return {k: v.clone() for k, v in state.tensors.items()}


def _steps(case: str, model: Any, backend: CommunicationBackend) -> list[float]:
    """Two SGD steps on this rank's share of a fixed batch (the pipelined ones through train_step)."""
    sharded = case in ("zero3", "fsdp/block", "dp2xtp2xpp2")
    opt = (ZeRO3Optimizer if sharded else DDPOptimizer)(model, torch.optim.SGD, lr=0.5)
    seqs = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(1))
    dp = model.dp_backend if hasattr(model, "mesh") else backend
    lo, hi = dp.rank * 8 // dp.world_size, (dp.rank + 1) * 8 // dp.world_size
    x, y = seqs[lo:hi, :-1], seqs[lo:hi, 1:]
    losses = []
    for _ in range(2):
        if getattr(model, "pipelined", False):
            loss = model.train_step((x, y), model.cross_entropy)
        else:
            logits = model(x)
            loss = model.cross_entropy(logits, y) if hasattr(model, "mesh") else _ce(logits, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _both(case: str) -> Any:
    def body(backend: CommunicationBackend) -> dict[str, Any]:
        with seeded_init(SEED):
            plain_net = _lm()
        plain = _wrap(case, plain_net, backend)
        with torch.device("meta"):
            meta_net = _lm()
        meta = _wrap(case, meta_net, backend, init_seed=SEED)
        a, b = _local(plain), _local(meta)
        full_a, full_b = plain.full_state_dict(), meta.full_state_dict()
        losses = (_steps(case, plain, backend), _steps(case, meta, backend))
        trained_a, trained_b = plain.full_state_dict(), meta.full_state_dict()
        return {
            "losses": losses,
            "trained_differ": sorted(k for k in trained_a if not torch.equal(trained_a[k], trained_b[k])),
            "keys": sorted(a) == sorted(b),
            "differ": sorted(k for k in a if not torch.equal(a[k], b[k])),
            "full_differ": sorted(k for k in full_a if not torch.equal(full_a[k], full_b[k])),
            "bytes": (plain.memory_report()["parameters"], meta.memory_report()["parameters"]),
            "meta_left": [
                n for n, t in [*meta.module.named_parameters(), *meta.module.named_buffers()] if t.is_meta
            ],
        }

    return body


@pytest.mark.parametrize("case", list(_WORLD))
def test_meta_construction_is_bitwise_the_plain_build(case: str) -> None:
    for rank, res in enumerate(run_world(_WORLD[case], _both(case))):
        assert res["keys"], (case, rank)
        assert res["differ"] == [], (case, rank)
        assert res["full_differ"] == [], (case, rank)
        assert res["bytes"][0] == res["bytes"][1], (case, rank)
        assert res["meta_left"] == [], (case, rank)
        plain_losses, meta_losses = res["losses"]
        assert meta_losses == plain_losses, (case, rank)  # bitwise: the same model trains the same
        assert res["trained_differ"] == [], (case, rank)


class _Scale(nn.Module):
    """A parameter nothing initializes (no reset_parameters) and a buffer computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.table


class _HalfReset(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # forgets the bias


def _refused(make: Any, wrap: str) -> str:
    def body(backend: CommunicationBackend) -> None:
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(4, 4), make())
        if wrap == "tp":
            TensorParallelModel(net, backend, plan={"0": "colwise"}, init_seed=0)
        else:
            PipelineParallelModel(net, backend, micro_batches=2, init_seed=0)

    with pytest.raises(Exception) as info:  # the message is checked by the caller
        run_world(2, body)
    return str(info.value)


def test_tensors_nothing_initializes_are_named_on_every_rank() -> None:
    """Under tensor and pipeline parallelism too: named before any step, on every rank alike (the walk
    covers the whole model, so a rank that does not hold the tensor raises too: no rank waits)."""
    for wrap in ("tp", "pp"):
        msg = _refused(_Scale, wrap)
        assert "'1.scale'" in msg and "_Scale" in msg and "param_init_fn" in msg, (wrap, msg)
        msg = _refused(lambda: _HalfReset(4, 4), wrap)
        assert "'bias'" in msg and "'1'" in msg and "uninitialized" in msg, (wrap, msg)

    def buffer_kept(backend: CommunicationBackend) -> torch.Tensor:
        def init(module: nn.Module) -> None:
            for q in module.parameters(recurse=False):
                nn.init.constant_(q, 0.5)

        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(4, 4), _Scale())
        assert net[1].table.is_meta  # torch.device("meta") puts buffers on meta too
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(4, 4), _Scale())
        net[1].table = torch.arange(4.0)  # a buffer kept from construction (on the real device)
        model = PipelineParallelModel(net, backend, micro_batches=2, init_seed=0, param_init_fn=init)
        return model.full_state_dict()["1.scale"]

    for scale in run_world(2, buffer_kept):
        assert torch.equal(scale, torch.full((4,), 0.5))


class _Table(nn.Module):
    """A linear layer and a buffer computed in ``__init__`` (no reset_parameters recomputes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("freq", 1.0 / (10000 ** (torch.arange(0, 8).float() / 8)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.freq


def _tabled() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), _Table(), nn.Linear(8, 8))


def test_init_empty_weights_keeps_buffers_and_only_this_thread() -> None:
    """Parameters on meta, the buffer computed: TP, PP and ZeRO-3 from it hold the plain build's
    values (the buffer included); a model another thread builds meanwhile is untouched."""

    def body(backend: CommunicationBackend) -> dict[str, Any]:
        with seeded_init(4):
            plain = _tabled()
        out: dict[str, Any] = {}
        for wrap in ("tp", "pp", "zero3"):
            with init_empty_weights():
                net = _tabled()
            out[f"{wrap}/on_meta"] = (net[0].weight.is_meta, net[1].freq.is_meta)
            if wrap == "tp":
                model: Any = TensorParallelModel(net, backend, plan={"1.lin": "colwise"}, init_seed=4)
            elif wrap == "pp":
                model = PipelineParallelModel(net, backend, micro_batches=2, init_seed=4)
            else:
                model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=4)
            full = model.full_state_dict()
            out[f"{wrap}/differ"] = [k for k, v in plain.state_dict().items() if not torch.equal(full[k], v)]
            if wrap != "pp" or backend.rank == 0:  # the pipeline's rank 1 holds no _Table
                out[f"{wrap}/freq"] = torch.equal(net[1].freq, plain[1].freq)
        return out

    for res in run_world(2, body):
        for wrap in ("tp", "pp", "zero3"):
            assert res[f"{wrap}/on_meta"] == (True, False), wrap
            assert res[f"{wrap}/differ"] == [], wrap
            assert res.get(f"{wrap}/freq", True), wrap

    built: list[nn.Module] = []
    with init_empty_weights():
        other = threading.Thread(target=lambda: built.append(nn.Linear(2, 2)))
        other.start()
        other.join(timeout=30)
        mine = nn.Linear(2, 2)
    assert mine.weight.is_meta and not built[0].weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the hook is gone after the block
