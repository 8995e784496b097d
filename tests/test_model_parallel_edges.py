"""The model-parallel composition at the edges its parity runs do not reach: which parameters are tied
across pipeline ranks, ``apply`` reaching the wrapper itself as torch's does, and a schedule name
checked where no pipeline runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError
from dtlab.models import HybridShardedModel, TensorParallelModel
from dtlab.models.pipeline._ties import cross_ties
from dtlab.testing import run_world

PLAN = {"0": "colwise", "1": "rowwise"}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(4, 2), nn.Linear(2, 2), nn.Linear(2, 4, bias=False)
        self.head.weight = self.emb.weight


def test_only_a_parameter_held_on_several_pipeline_ranks_is_a_cross_tie() -> None:
    net = _Tied()
    holders = {id(net.emb.weight): {1, 0}, id(net.mid.weight): {0}, id(net.mid.bias): {1}}
    ties = cross_ties(net, holders)
    assert [(t.names, t.ranks) for t in ties] == [(["emb.weight", "head.weight"], [0, 1])]


def _applied(backend: CommunicationBackend) -> bool:
    model = TensorParallelModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), backend, PLAN)
    seen: list[nn.Module] = []
    returned = model.apply(seen.append)
    return returned is model and seen[-1] is model and any(isinstance(m, nn.Linear) for m in seen)


def test_apply_reaches_every_module_then_the_model_itself_as_torchs() -> None:
    assert run_world(2, _applied) == [True, True]


def test_an_unknown_schedule_is_named_where_no_pipeline_runs() -> None:
    def build(backend: CommunicationBackend) -> None:
        HybridShardedModel(nn.Linear(4, 4), Mesh(backend, {"dp": 2}), "ddp", schedule="1fb1")

    with pytest.raises(RankFailedError, match=r"unknown pipeline schedule '1fb1'; choose one of"):
        run_world(2, build)


def _tied_on_meta(backend: CommunicationBackend, data_parallel: str) -> list[str]:
    from test_meta_init import _net  # an embedding tied to the last Linear after construction

    extra: dict[str, Any] = {"persistence_threshold": 0} if data_parallel == "zero3" else {}
    with seeded_init(7):
        built = _net()
    plain = HybridShardedModel(built, Mesh(backend, {"dp": 2}), data_parallel, **extra)
    with torch.device("meta"):
        net = _net()
    meta = HybridShardedModel(net, Mesh(backend, {"dp": 2}), data_parallel, init_seed=7, **extra)
    want, got = plain.full_state_dict(), meta.full_state_dict()
    return sorted(k for k in want if not torch.equal(want[k], got[k]))


@pytest.mark.parametrize("data_parallel", ["zero3", "fsdp"])
def test_a_tied_model_built_on_meta_is_bitwise_the_plain_build(data_parallel: str) -> None:
    """The tied weight is initialized once, by its first module, as the plain build keeps it."""
    assert run_world(2, _tied_on_meta, data_parallel) == [[], []]


def _by_keyword(backend: CommunicationBackend) -> list[str]:
    model = TensorParallelModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), backend, tensor_plan=PLAN)
    return [type(m).__name__ for m in model.module]


def test_the_plan_given_as_tensor_plan_is_the_one_applied() -> None:
    assert run_world(2, _by_keyword) == [["ColumnParallelLinear", "RowParallelLinear"]] * 2


class _ChildNamedModule(nn.Module):
    """A model whose own submodule is called ``module``: its keys are not a torch DDP checkpoint's."""

    def __init__(self) -> None:
        super().__init__()
        self.module, self.head = nn.Linear(3, 2), nn.Linear(2, 1)


def _reloaded(backend: CommunicationBackend) -> list[str]:
    model = HybridShardedModel(_ChildNamedModule(), Mesh(backend, {"dp": 2}), "ddp")
    state = model.full_state_dict()
    model.load_state_dict(state)  # strict
    model.load_state_dict({f"module.{k}": v for k, v in state.items()})  # saved from torch's DDP
    return sorted(state)


def test_a_state_dict_of_a_child_named_module_is_not_taken_for_a_ddp_prefix() -> None:
    want = ["head.bias", "head.weight", "module.bias", "module.weight"]
    assert run_world(2, _reloaded) == [want, want]
