"""``nn.SyncBatchNorm`` under the data-parallel strategies: statistics over the data-parallel group on
every engine, equal to one process's BatchNorm on the global batch (outputs, input and parameter
gradients, running statistics), with unequal per-rank batches; evaluation without communication; what
is refused; plain ``nn.BatchNorm`` keeps torch DDP's rank-0 buffers. The Gloo check (torch.distributed
initialized) is in tests/test_torch_habits.py's one spawned world."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from sync_bn_cases import LR, SPLITS, compare, distributed, make_data, make_module, reference, rel, run
from test_strategies_helpers import STRATEGIES, wrap
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, Any]]:
    return {world: reference(world) for world in SPLITS}


@pytest.mark.parametrize("name", STRATEGIES)
def test_sync_batchnorm_is_the_global_batch_norm(name: str, references: dict[int, dict[str, Any]]) -> None:
    for world in SPLITS:
        for rank, res in enumerate(run_world(world, distributed, name, timeout=60)):
            compare(res, references[world], world, f"{name}, {world} ranks, rank {rank}")


def on_mesh(backend: CommunicationBackend) -> dict[str, Any]:
    """A 2 x 2 mesh: each tp coordinate trains on a global batch of its own over its dp group, so the
    statistics must be the dp group's, not the world's."""
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    return distributed(mesh["dp"], "zero2", seed=3 + mesh.coordinate("tp"), world=mesh.backend)


def test_statistics_over_the_dp_group_of_a_mesh() -> None:
    refs = [reference(2, seed=3 + tp) for tp in (0, 1)]
    for rank, res in enumerate(run_world(4, on_mesh, timeout=60)):
        compare(res, refs[rank % 2], 2, f"zero2 over mesh['dp'], rank {rank}")


def hybrid_dp_only(backend: CommunicationBackend) -> tuple[torch.Tensor, slice]:
    model = HybridShardedModel(make_module(sync=True), Mesh(backend, {"dp": 2}), data_parallel="zero1")
    mine = slice(0, 3) if backend.rank == 0 else slice(3, 8)
    return model(make_data()[0][0, mine]).detach(), mine


def test_the_composition_with_dp_alone_synchronizes(references: dict[int, dict[str, Any]]) -> None:
    for out, mine in run_world(2, hybrid_dp_only, timeout=60):
        assert rel(out, references[2]["outs"][0][mine]) < 1e-5


def refusals(backend: CommunicationBackend) -> dict[str, str]:
    class OwnForward(nn.SyncBatchNorm):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input)

    found = {}
    grouped = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2, process_group=1))
    cases = {
        "process_group": lambda: wrap("ddp", grouped, backend),
        "own_forward": lambda: wrap("zero3", nn.Sequential(nn.Linear(2, 2), OwnForward(2)), backend),
        "pipeline": lambda: PipelineParallelModel(make_module(sync=True), backend, micro_batches=2),
        "tensor": lambda: TensorParallelModel(make_module(sync=True), backend, tensor_plan={"4": "colwise"}),
    }
    for what, build in cases.items():
        with pytest.raises(StrategyError) as info:
            build()
        found[what] = str(info.value)
    return found


def test_what_cannot_be_synchronized_is_refused() -> None:
    for res in run_world(2, refusals, timeout=60):
        assert "'1' was given a process_group" in res["process_group"], res
        assert "has its own forward (OwnForward)" in res["own_forward"], res
        assert "under a pipeline: its statistics would be each micro-batch's" in res["pipeline"], res
        assert "are nn.SyncBatchNorm, not synchronized under tp" in res["tensor"], res


def plain_batchnorm(backend: CommunicationBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """torch DDP's habit for plain BatchNorm: per-rank statistics in training, rank 0's buffers copied
    to every rank at each forward (``broadcast_buffers=True``)."""
    x, y, x_eval = make_data()
    model = wrap("ddp", make_module(sync=False), backend)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    mine = slice(backend.rank * 4, backend.rank * 4 + 4)
    run(model, opt, x[:1, mine], y[:1, mine], 1.0)
    own = model.module[1].running_mean.clone()
    model.eval()
    model(x_eval)
    return own, model.module[1].running_mean.clone()


def test_plain_batchnorm_keeps_rank0_buffers_like_torch_ddp() -> None:
    (own0, after0), (own1, after1) = run_world(2, plain_batchnorm, timeout=60)
    assert not torch.equal(own0, own1)  # each rank's own batch in training
    assert torch.equal(after0, own0) and torch.equal(after1, own0)  # rank 0's at the next forward


def copies(backend: CommunicationBackend) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A copy of the wrapped module (torch's AveragedModel: an EMA) keeps syncing over the group, so
    ``update_bn`` gives the global batches' statistics; a pickled one is torch's own SyncBatchNorm
    (local statistics without torch.distributed)."""
    model = wrap("ddp", make_module(sync=True), backend)
    x = make_data()[0][:, backend.rank * 4 : backend.rank * 4 + 4]
    ema = AveragedModel(model.module)
    update_bn(list(x), ema)
    pickled = pickle.loads(pickle.dumps(model.module))
    pickled(x[0])
    return {k: v for k, v in ema.module.state_dict().items() if "running" in k}, pickled[1].running_mean


def test_copies_of_the_module() -> None:
    ema = AveragedModel(make_module(sync=False))
    update_bn(list(make_data()[0]), ema)
    (copied0, pickled0), (copied1, pickled1) = run_world(2, copies, timeout=60)
    for copied in (copied0, copied1):
        assert max(rel(copied[k], v) for k, v in ema.module.state_dict().items() if "running" in k) < 1e-5
    assert not torch.equal(pickled0, pickled1)


def compiled(backend: CommunicationBackend) -> dict[str, Any]:
    """``torch.compile`` (dynamo; aot_eager keeps it cheap) leaves the synchronized layers eager."""
    return distributed(backend, "ddp", compile_module=True)


def test_compiled_module(references: dict[int, dict[str, Any]]) -> None:
    for rank, res in enumerate(run_world(2, compiled, timeout=120)):
        compare(res, references[2], 2, f"compiled, rank {rank}")
