"""Data-parallel strategies on a group of a wider world (``DDPModel(module, mesh["dp"], world=...)``).

On 4 in-memory ranks, ``Mesh(backend, {"dp": 2, "tp": 2})`` gives two dp groups, {0, 2} and {1, 3}
(tp is only a replica axis here). Each group trains on its own data: parameters must equal plain
single-process training on that group's global batch (every strategy), gradients and parameter
traffic must stay inside the group, and consensus (a NaN on one rank, ``agree``) must span all four
ranks so every rank skips the same step. The Trainer samples by dp rank and averages the loss over dp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_strategies_helpers import (
    OPTIMIZERS,
    STRATEGIES,
    make_data,
    make_module,
    max_rel_error,
    optimizer_for,
    wrap,
)
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.config import TrainConfig, load_config
from dtlab.core import seeded_init
from dtlab.errors import ArgumentError
from dtlab.models import DDPModel
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import Task, run_training
from dtlab.trainers.build import BuiltModel
from dtlab.trainers.construction import Construction

STEPS, GLOBAL_BATCH, NAN_STEP, NAN_RANK = 5, 8, 2, 3


def _reference(group: int, skip: int) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH, seed=10 + group)
    module = make_module()
    ocls, kw = OPTIMIZERS["adamw"]
    opt = ocls(module.parameters(), **kw)
    for s in range(STEPS):
        if s != skip:
            nn.functional.mse_loss(module(x[s]), y[s]).backward()
            opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _own_calls(world: CommunicationBackend, *groups: CommunicationBackend) -> dict[str, tuple[int, int]]:
    """(calls, bytes sent) the world backend made itself: its counters less its sub-groups'."""
    own = {}
    for kind in world.stats.kinds():
        calls = world.stats[kind].calls - sum(g.stats[kind].calls for g in groups)
        sent = world.stats[kind].bytes_sent - sum(g.stats[kind].bytes_sent for g in groups)
        if calls or sent:
            own[kind] = (calls, sent)
    return own


def _train_on_mesh(backend: CommunicationBackend, strategy: str) -> dict[str, Any]:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    dp, tp = mesh["dp"], mesh["tp"]
    group = mesh.coordinate("tp")  # which dp group this rank is in
    x, y = make_data(STEPS, GLOBAL_BATCH, seed=10 + group)
    model = wrap(strategy, make_module(), dp, world=backend)
    opt = optimizer_for(strategy, model, "adamw")
    for b in (backend, dp, tp):
        b.stats.reset()
    local, r = GLOBAL_BATCH // dp.world_size, dp.rank
    applied = []
    for s in range(STEPS):
        xb, yb = x[s, r * local : (r + 1) * local].clone(), y[s, r * local : (r + 1) * local]
        if s == NAN_STEP and backend.rank == NAN_RANK:
            xb[0, 0] = float("nan")
        nn.functional.mse_loss(model(xb), yb).backward()
        ok = opt.grads_are_finite()
        applied.append(ok)
        if ok:
            opt.clip_grad_norm_(1e9)  # a norm over the dp group only: nothing to clip, must not hang
            opt.step()
        opt.zero_grad()
    own = _own_calls(backend, dp, tp)
    probe = torch.zeros(1, dtype=torch.int32)
    before = backend.stats["all_reduce"].bytes_sent
    backend.all_reduce(probe, ReduceOp.MAX)  # what one 4-byte world all-reduce costs this rank
    one_world_flag = backend.stats["all_reduce"].bytes_sent - before
    return {
        "group": group,
        "state": model.full_state_dict(),
        "applied": applied,
        "agree": (opt.agree(True), opt.agree(backend.rank != 1)),
        "own": own,
        "one_world_flag": one_world_flag,
        "tp_traffic": tp.stats.calls,
        "backends": (model.dp_backend is dp, model.world_backend is backend, model.backend is dp),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp_groups_train_independently_and_skip_together(strategy: str) -> None:
    results = run_world(4, _train_on_mesh, strategy, timeout=60)
    refs = {g: _reference(g, skip=NAN_STEP) for g in (0, 1)}
    expected = [s != NAN_STEP for s in range(STEPS)]
    for rank, res in enumerate(results):
        where = f"{strategy}, rank {rank}"
        assert res["group"] == rank % 2, where
        assert res["backends"] == (True, True, True), where
        # the NaN on rank 3 (group 1) skips the step on all four ranks, group 0 included
        assert res["applied"] == expected, f"{where}: {res['applied']}"
        assert res["agree"] == (True, False), where
        err = max_rel_error(res["state"], refs[res["group"]])
        assert err <= 1e-5, f"{where}: relative error {err:.2e} against its group's single process"
        # gradients and parameters travel only inside the dp group; the world carries exactly one
        # 4-byte all-reduce per step (the finite-gradient consensus)
        assert res["tp_traffic"] == 0, where
        assert res["own"] == {"all_reduce": (STEPS, STEPS * res["one_world_flag"])}, f"{where}: {res['own']}"
    assert max_rel_error(refs[0], refs[1]) > 1e-3  # the two groups really trained differently


def _errors(backend: CommunicationBackend) -> None:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    with pytest.raises(ArgumentError, match=r"world has 2 ranks but the data-parallel group has 4"):
        DDPModel(make_module(), backend, world=mesh["tp"])
    with pytest.raises(TypeError, match="world must be a dtlab CommunicationBackend"):
        DDPModel(make_module(), mesh["dp"], world="world")  # type: ignore[arg-type]
    plain = DDPModel(make_module(), mesh["dp"])
    assert plain.world_backend is plain.dp_backend is mesh["dp"]


def test_world_argument_errors() -> None:
    run_world(4, _errors, timeout=30)


# ---------------------------------------------------------------------------- the trainer
def _cfg(tmp: Path, world_size: int) -> TrainConfig:
    return load_config(
        overrides=[
            "backend.name=inmemory",
            f"backend.world_size={world_size}",
            *TINY_LM,
            "train.steps=4",
            "train.eval_every=2",
            "optimizer.warmup_steps=1",
            "logging.progress=false",
            f"logging.run_dir={tmp / str(world_size)}",
        ]
    )


def test_trainer_samples_and_averages_over_dp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 ranks as two dp groups of 2 must train exactly like a plain 2-rank world, in each group."""
    plain = run_training(_cfg(tmp_path, 2))

    def build_on_mesh(
        config: TrainConfig, backend: CommunicationBackend, task: Task, *_plan_and_precision: Any
    ) -> BuiltModel:
        mesh = Mesh(backend, {"dp": 2, "tp": 2})
        with seeded_init(config.train.seed):  # as build_model: same initial model
            module = task.build_model()
        n = sum(p.numel() for p in module.parameters())
        model = DDPModel(module, mesh["dp"], world=backend)
        return BuiltModel(model, n, Construction("plain", 4 * n, 4 * n, 4 * n))

    monkeypatch.setattr("dtlab.trainers.trainer.build_model", build_on_mesh)
    meshed = run_training(_cfg(tmp_path, 4))
    ref = plain[0]
    assert len(ref.losses) == 4 and len(ref.evals) == 2
    for res in meshed:
        for (s, loss), (s_ref, loss_ref) in zip(res.losses, ref.losses, strict=True):
            assert s == s_ref and loss == pytest.approx(loss_ref, rel=1e-5), (
                res.rank,
                res.losses,
                ref.losses,
            )
        for (s, ev), (s_ref, ev_ref) in zip(res.evals, ref.evals, strict=True):
            assert s == s_ref and ev["eval_loss"] == pytest.approx(ev_ref["eval_loss"], rel=1e-5)
