"""The model-parallel composition at the edges its parity runs do not reach: which parameters are tied
across pipeline ranks, ``apply`` reaching the wrapper itself as torch's does, and a schedule name
checked where no pipeline runs."""

from __future__ import annotations

import pytest
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
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
