"""A plain torch optimizer's ``state_dict()`` (one process's: whole tensors of every parameter) loaded
into a tensor- or pipeline-parallel rank's optimizer strategy, on 2 in-memory ranks. Such a rank
holds only its tp slices or its stages, so it cannot load it: it was refused, but as state "saved for
another model or other param groups" with the fix "build the optimizer with the groups it was saved
with", which the user had done. It is now named as a whole model's state with the way that works:
load it under DDPOptimizer, save ``opt.sharded_state_dict()`` and load that on the mesh, which then
steps as the one process would (checked here after one more AdamW step)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from filled import filled
from test_tensor_habits import PLAN, build, data
from torch import nn
from torch.nn import functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models import DDPModel, PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world

WHOLE = "It is a whole model's optimizer state"


def _net(pp: bool) -> nn.Module:
    if pp:
        return filled(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), 0, scale=0.4)
    return build()


def _step(model: Any, pp: bool, s: int) -> None:
    x, y = data(s)
    if pp:
        model.train_step((x, y), F.cross_entropy)
    else:
        F.cross_entropy(model(x), y).backward()


def one_process(pp: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The optimizer state and the module after one AdamW step; the module after a second."""
    net = _net(pp)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    _step(net, False, 0)
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))  # the next step changes them in place
    _step(net, False, 1)
    opt.step()
    return saved[1], saved[0], net.state_dict()


def resharded(backend: CommunicationBackend, pp: bool, sd: dict[str, Any], module: Any) -> ShardedState:
    """The fix's first half: the whole state loaded under DDP, saved in dtlab's sharded form."""
    net = _net(pp)
    net.load_state_dict(module)
    model = DDPModel(net, backend)
    opt = DDPOptimizer(model, torch.optim.AdamW(model.module.parameters(), lr=0.01))
    opt.load_state_dict(sd)
    return opt.sharded_state_dict()


def on_mesh(backend: CommunicationBackend, pp: bool, sd: dict[str, Any], module: Any, shards: Any) -> Any:
    torch.set_num_threads(1)
    net = _net(pp)
    net.load_state_dict(module)
    mesh = Mesh(backend, {"pp" if pp else "tp": 2})
    model: Any = (
        PipelineParallelModel(net, mesh, micro_batches=2) if pp else TensorParallelModel(net, mesh, plan=PLAN)
    )
    opt = DDPOptimizer(model, torch.optim.AdamW(model.module.parameters(), lr=0.01))
    try:
        opt.load_state_dict(sd)
        said = "loaded"
    except StrategyError as exc:
        said = str(exc)
    opt.load_sharded_state_dict(shards)
    _step(model, pp, 1)
    opt.step()
    return said, model.full_state_dict()


def test_a_whole_models_optimizer_state_on_a_mesh_names_the_way_that_works() -> None:
    for pp in (False, True):
        sd, module, want = one_process(pp)
        shards = run_world(2, resharded, pp, sd, module, timeout=60)
        for rank, (said, got) in enumerate(run_world(2, on_mesh, pp, sd, module, shards, timeout=60)):
            where = f"{'pp' if pp else 'tp'}=2 rank {rank}"
            assert WHOLE in said and "opt.sharded_state_dict()" in said and "DDPOptimizer" in said, (
                f"{where}: {said}"
            )
            err = max(float((got[k] - want[k]).abs().max()) for k in want)
            assert err <= 1e-6, f"{where}: {err:.2e} from one process after the resharded load"
