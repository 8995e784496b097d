"""Tensor-parallel checkpoints are placed shards: a tp=4 checkpoint (model and AdamW state) resumes at
dp2 x tp2 under ZeRO-1, under plain DDP and as the plain module, and a DDP checkpoint loads at tp=2;
every resumed run ends where 5 uninterrupted single-process steps end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from test_tensor_helpers import OPTIMIZERS, batch, build, initial_state, max_rel_error, train_reference

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.core.state import ShardedState
from dtlab.models import DDPModel, ShardIndex, TensorParallelModel, transformer_plan
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world

OPT = "adamw"
FIRST, REST = 2, 3


def _train(model: Any, opt: Any, steps: int, dp: int, coord: int, tp_loss: bool) -> None:
    x, y = batch()
    x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
    for _ in range(steps):
        out = model(x)
        loss = (
            model.cross_entropy(out, y)
            if tp_loss
            else torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))
        )
        loss.backward()
        opt.step()
        opt.zero_grad()


def save_tp4(backend: CommunicationBackend, root: Path) -> None:
    """Train and write the checkpoint files (safetensors shards + JSON metadata) as the trainer does."""
    cls, kwargs, dtype = OPTIMIZERS[OPT]
    model = TensorParallelModel(build(initial_state(), dtype), Mesh(backend, {"tp": 4}), transformer_plan())
    opt = DDPOptimizer(model, cls, **kwargs)
    _train(model, opt, FIRST, 1, 0, True)
    save_checkpoint(root, FIRST, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {}, {})


def resume_tensor(
    backend: CommunicationBackend,
    shape: dict[str, int],
    strategy: str,
    saved: list[tuple[ShardedState, ShardedState]],
) -> tuple[dict[str, torch.Tensor], tuple[ShardedState, ShardedState]]:
    cls, kwargs, dtype = OPTIMIZERS[OPT]
    mesh = Mesh(backend, shape)
    model = TensorParallelModel(build(None, dtype), mesh, transformer_plan(sequence_parallel=True))
    opt = (ZeRO1Optimizer if strategy == "zero1" else DDPOptimizer)(model, cls, **kwargs)
    model.load_sharded_state_dict([m for m, _ in saved])
    opt.load_sharded_state_dict([o for _, o in saved])
    _train(model, opt, REST, mesh.size("dp"), mesh.coordinate("dp"), True)
    return model.full_state_dict(), (model.sharded_state_dict(), opt.sharded_state_dict())


def resume_ddp(
    backend: CommunicationBackend, saved: list[tuple[ShardedState, ShardedState]]
) -> tuple[dict[str, torch.Tensor], tuple[ShardedState, ShardedState]]:
    cls, kwargs, dtype = OPTIMIZERS[OPT]
    model = DDPModel(build(None, dtype), backend)
    opt = DDPOptimizer(model, cls, **kwargs)
    model.load_sharded_state_dict([m for m, _ in saved])
    opt.load_sharded_state_dict([o for _, o in saved])
    _train(model, opt, REST, backend.world_size, backend.rank, False)
    return model.full_state_dict(), (model.sharded_state_dict(), opt.sharded_state_dict())


def test_tp4_checkpoint_resumes_at_tp2_in_ddp_and_as_the_plain_module(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _, ref_first = train_reference(OPT, FIRST)
    _, ref = train_reference(OPT, FIRST + REST)
    run_world(4, save_tp4, tmp_path)
    loaded = read_checkpoint(tmp_path)
    assert loaded.optim is not None
    saved = list(zip(loaded.model, loaded.optim, strict=True))

    # the plain module: full tensors keyed like module.state_dict()
    index = ShardIndex([m for m, _ in saved])
    plain = {k: index.full(k) for k in index.keys()}
    assert max_rel_error(plain, ref_first) <= 1e-10

    for shape, strategy in (({"dp": 2, "tp": 2}, "zero1"), ({"tp": 2}, "ddp")):
        results = run_world(4 if "dp" in shape else 2, resume_tensor, shape, strategy, saved)
        for rank, (state, _) in enumerate(results):
            assert max_rel_error(state, ref) <= 1e-10, f"tp4 -> {shape} {strategy}, rank {rank}"

    ddp = run_world(2, resume_ddp, saved)
    for rank, (state, _) in enumerate(ddp):
        assert max_rel_error(state, ref) <= 1e-10, f"tp4 -> DDP, rank {rank}"

    # a DDP checkpoint (flat slices) into tensor parallelism: the loaded shards are DDP's tensors
    back = run_world(2, load_only, [s for _, s in ddp])
    for rank, state in enumerate(back):
        assert max_rel_error(state, ddp[0][0]) == 0.0, f"DDP -> tp2, rank {rank}"


def load_only(
    backend: CommunicationBackend, saved: list[tuple[ShardedState, ShardedState]]
) -> dict[str, torch.Tensor]:
    cls, kwargs, dtype = OPTIMIZERS[OPT]
    model = TensorParallelModel(build(None, dtype), Mesh(backend, {"tp": 2}), transformer_plan())
    opt = DDPOptimizer(model, cls, **kwargs)
    model.load_sharded_state_dict([m for m, _ in saved])
    opt.load_sharded_state_dict([o for _, o in saved])
    return model.full_state_dict()
