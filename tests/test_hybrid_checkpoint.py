"""Hybrid checkpoints across meshes: the model and optimizer shards saved at 2 x 2 x 2 (FSDP on dp,
tensor and pipeline parallel) load at pp=4, into FSDP at dp=4 and into DDP at 2 ranks with identical
parameters, and training continues as the uninterrupted run does; the plain module's tensors come out
of the shards (what ``dtlab consolidate`` writes)."""

from __future__ import annotations

from typing import Any

import torch
from hybrid_cases import hybrid_model
from test_tensor_helpers import OPTIMIZERS, batch, build, max_rel_error

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards
from dtlab.core.state import ShardedState
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy
from dtlab.models.base import ModelStrategy
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.testing import run_world
from dtlab.trainers.models import Block

CUBE = {"pp": 2, "dp": 2, "tp": 2}
SAVED_AFTER = 2


def _step(model: ModelStrategy, opt: OptimizerStrategy, dp: int, coord: int) -> None:
    x, y = batch()
    x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
    cross_entropy = getattr(model, "cross_entropy", None)
    if hasattr(model, "mesh"):
        model.train_step((x, y), cross_entropy or _plain_ce)
    else:
        _plain_ce(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _plain_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def save_world(backend: CommunicationBackend) -> dict[str, Any]:
    """2 steps at 2 x 2 x 2, the shards, then one more step (the uninterrupted continuation)."""
    cls, kwargs, dtype = OPTIMIZERS["adamw"]
    model = hybrid_model(backend, CUBE, "fsdp", dtype, sequence_parallel=True, micro_batches=2)
    opt = ZeRO3Optimizer(model, cls, **kwargs)
    dp, coord = model.mesh.size("dp"), model.mesh.coordinate("dp")
    for _ in range(SAVED_AFTER):
        _step(model, opt, dp, coord)
    saved = {
        "model": model.sharded_state_dict(),
        "optim": opt.sharded_state_dict(),
        "full": model.full_state_dict(),
    }
    _step(model, opt, dp, coord)
    saved["continued"] = model.full_state_dict()
    return saved


def load_world(
    backend: CommunicationBackend,
    where: str,
    model_shards: list[ShardedState],
    optim_shards: list[ShardedState],
) -> dict[str, Any]:
    """Load at another mesh or strategy; the loaded full state and the state after one more step."""
    cls, kwargs, dtype = OPTIMIZERS["adamw"]
    net = build(None, dtype)
    model: ModelStrategy
    if where == "pp4":
        mesh = Mesh(backend, {"pp": 4})
        model = hybrid_model(mesh, {"pp": 4}, "ddp", dtype, micro_batches=4)
        opt: OptimizerStrategy = DDPOptimizer(model, cls, **kwargs)
        dp, coord = 1, 0
    elif where == "fsdp_dp4":
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)))
        opt = ZeRO3Optimizer(model, cls, **kwargs)
        dp, coord = backend.world_size, backend.rank
    else:
        model = DDPModel(net, backend)
        opt = DDPOptimizer(model, cls, **kwargs)
        dp, coord = backend.world_size, backend.rank
    model.load_sharded_state_dict(model_shards)
    opt.load_sharded_state_dict(optim_shards)
    loaded = model.full_state_dict()
    _step(model, opt, dp, coord)
    return {"loaded": loaded, "continued": model.full_state_dict()}


def test_a_cube_checkpoint_loads_at_other_meshes_and_strategies() -> None:
    saved = run_world(8, save_world, timeout=120)
    model_shards = [s["model"] for s in saved]
    optim_shards = [s["optim"] for s in saved]
    full, continued = saved[0]["full"], saved[0]["continued"]
    for s in saved[1:]:
        assert all(torch.equal(s["full"][k], v) for k, v in full.items())
    # the plain module's tensors, as dtlab consolidate writes them
    plain = full_tensors_from_shards(model_shards)
    assert plain.keys() == full.keys() and all(torch.equal(plain[k], full[k]) for k in full)
    net = build(None, torch.float64)
    net.load_state_dict(plain)
    for where, world in (("pp4", 4), ("fsdp_dp4", 4), ("ddp2", 2)):
        for rank, out in enumerate(
            run_world(world, load_world, where, model_shards, optim_shards, timeout=120)
        ):
            assert out["loaded"].keys() == full.keys()
            for k, v in full.items():
                assert torch.equal(out["loaded"][k], v), f"{where} rank {rank}: {k} differs after loading"
            err = max_rel_error(out["continued"], continued)
            assert err <= 1e-5, f"{where} rank {rank}: continuation relative error {err:.2e}"
