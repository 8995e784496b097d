"""Model initialisation is the same in every run however the task is built: in-memory ranks are
threads sharing torch's global RNG, and a task built inside each rank's function used to race on it."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.core import seeded_init
from dtlab.core.plan import RunPlan
from dtlab.data import TensorDataset
from dtlab.models import HybridShardedModel
from dtlab.testing import run_world
from dtlab.trainers import Task, Trainer
from dtlab.zoo import TransformerLM


def _net() -> nn.Module:  # big enough that building it takes a while: concurrent builds overlap
    return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def _first_loss(backend: CommunicationBackend, config: TrainConfig) -> float:
    # the quickstart's pattern: the task (data and model builder) made inside each rank's function
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    task = Task(build_model=_net, train_data=data, eval_data=data)
    return Trainer(config, backend, task).fit().losses[0][1]


def test_a_task_built_in_each_rank_gives_the_same_first_loss_in_5_runs() -> None:
    cfg = load_config(
        overrides=[
            "backend.name=inmemory",
            "train.steps=1",
            "train.eval_every=0",
            "data.global_batch_size=16",
            "logging.progress=false",
            "logging.run_dir=null",
        ]
    )
    losses = [run_world(4, _first_loss, cfg) for _ in range(5)]
    assert all(run == [losses[0][0]] * 4 for run in losses), losses  # every rank, every run


def test_seeded_init_in_concurrent_threads_builds_the_same_model() -> None:
    with seeded_init(7):
        want = _net().state_dict()
    got: list[dict[str, torch.Tensor]] = []

    def build() -> None:
        for _ in range(5):
            with seeded_init(7):
                got.append(_net().state_dict())

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 20
    for sd in got:
        assert all(torch.equal(sd[k], want[k]) for k in want)


def test_splitting_a_model_over_tp_and_dp_draws_nothing_from_the_global_rng() -> None:
    """A rank wrapping its model draws nothing from torch's global RNG: a draw there, outside the lock,
    lands in the middle of another rank's build under seeded_init and changes that rank's model (each
    tensor-parallel layer used to initialise itself before taking the source's values)."""
    with seeded_init(0):
        net = TransformerLM(32, 2, 2, 16)  # embedding, fused qkv, MLP and head: every tp layer kind
    before = torch.get_rng_state()

    def body(backend: CommunicationBackend) -> None:
        HybridShardedModel.from_plan(copy.deepcopy(net), backend, RunPlan("zero1", tp=2))

    run_world(4, body, timeout=60)
    assert torch.equal(torch.get_rng_state(), before)
