"""ElasticOptimizer when a training step raises on every rank and is caught (a bad batch skipped): it
delegates the step to the inner strategy, so the next steps equal plain training minus the bad batch,
and a commit made right after the exception (before ``opt.zero_grad()``, while the gradients are
partial) holds the parameters and optimizer state of the steps before it: restored in a fresh world it
equals plain training over the batches before the bad one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from raised_cases import BAD, STEPS, BadBatch, Trap
from steps import plain_steps
from test_strategies_helpers import OPTIMIZERS, make_data, make_module, max_rel_error, optimizer_for, wrap
from test_strategies_raised_steps import SMALL_BUCKETS
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.optimizers.elastic import ElasticOptimizer, MemoryCommitStore, StaticMember
from dtlab.testing import run_world

BATCH = 4


def _elastic(b: CommunicationBackend, name: str, store: MemoryCommitStore) -> tuple[Any, ElasticOptimizer]:
    module = make_module()
    model = wrap(name, module, b, **({"bucket_cap_mb": SMALL_BUCKETS} if name == "ddp" else {}))
    return module, ElasticOptimizer(
        optimizer_for(name, model, "adamw"), commit_every=1, member=StaticMember(store)
    )


def _train(b: CommunicationBackend, name: str, case: str, stores: list[MemoryCommitStore]) -> dict[str, Any]:
    x, y = make_data(STEPS, BATCH)
    module, opt = _elastic(b, name, MemoryCommitStore())
    trap = Trap()
    module[1].register_forward_hook(trap.after_block)
    model = opt.model
    mine = slice(2 * b.rank, 2 * b.rank + 2)
    for step in range(STEPS):
        trap.case = case if step == BAD else None
        try:
            trap.loss(model(x[step, mine]), y[step, mine]).backward()
        except BadBatch:
            trap.case = None
            opt.end_step(step + 1)  # a commit while the gradients are partial
            for key in opt.member.store.keys():  # what a restore after a failure here would read
                stores[b.rank].put(opt.member.store.get(key))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        opt.end_step(step + 1)
    return model.full_state_dict()


def _restore(b: CommunicationBackend, name: str, stores: list[MemoryCommitStore]) -> dict[str, Any]:
    _, opt = _elastic(b, name, stores[b.rank])
    commit = opt.restore()
    return {"step": None if commit is None else commit.key.step, "state": opt.model.full_state_dict()}


def _reference(steps: list[int]) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    ocls, kw = OPTIMIZERS["adamw"]
    plain_steps(
        module, ocls(module.parameters(), **kw), zip(x[steps], y[steps], strict=True), nn.functional.mse_loss
    )
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("case", ["backward_function", "forward", "loss"])
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_elastic_skips_the_batch_and_its_commit_restores_the_steps_before(name: str, case: str) -> None:
    stores = [MemoryCommitStore() for _ in range(2)]
    want = _reference([s for s in range(STEPS) if s != BAD])
    for rank, state in enumerate(run_world(2, _train, name, case, stores, timeout=30)):
        err = max_rel_error(state, want)
        assert err <= 1e-5, f"{name} {case} rank {rank}: off by {err:.3g}"
    before = _reference(list(range(BAD)))
    for rank, res in enumerate(run_world(2, _restore, name, stores, timeout=30)):
        assert res["step"] == BAD + 1
        err = max_rel_error(res["state"], before)
        assert err <= 1e-5, f"{name} {case} restored rank {rank}: off by {err:.3g}"
