"""GradientCompressionOptimizer with Ok-Topk when a training step raises on every rank and is caught (a
bad batch skipped): in the forward, the loss, or a backward raising before any buffer was reduced, the
next steps equal compressed training over the same batches minus the bad one, exactly; a backward
raising after some buffers went through Ok-Topk (their residuals, thresholds and iteration counts
changed) is refused until ``clear_state()``, and then equals compressed training that skipped the batch
and restarted error feedback there. Also under ``ElasticOptimizer``: its commit (like a checkpoint) is
refused while that state is unusable, so a restore cannot bring it back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from raised_cases import BAD, STEPS, BadBatch, Trap
from test_strategies_helpers import STRATEGIES, make_data, make_module, max_rel_error, optimizer_for, wrap
from test_strategies_raised_steps import _options
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import NonFiniteGradientError, OkTopk
from dtlab.errors import StrategyError
from dtlab.optimizers import ElasticOptimizer, GradientCompressionOptimizer
from dtlab.testing import run_world

BATCH = 4
# (where the trap sits, what raises): the Block raises after the last layer's bucket/unit was reduced,
# the last layer before any was
CASES = {
    "forward": (1, "forward"),
    "loss": (1, "loss"),
    "backward_first": (3, "backward_function"),
    "backward_partway": (1, "backward_function"),
    "nonfinite": (1, "nan_input"),  # the reducer's own NonFiniteGradientError, at the first buffer
}


def _train(b: CommunicationBackend, name: str, case: str | None, elastic: bool = False) -> dict[str, Any]:
    """Compressed training over STEPS batches; ``case``: how step BAD raises (None: the reference,
    which skips step BAD, restarting error feedback there when the case needs it)."""
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    trap = Trap()
    where, what = CASES[case or "forward"]
    module[where].register_forward_hook(trap.after_block)
    model = wrap(name, module, b, **_options(name))
    compressor = OkTopk(density=0.3, warmup_steps=1, tau=2, tau_prime=2)
    opt: Any = GradientCompressionOptimizer(optimizer_for(name, model, "sgd"), compressor, dense_below=0)
    if elastic:
        opt = ElasticOptimizer(opt, commit_every=1)
    mine = slice(2 * b.rank, 2 * b.rank + 2)
    out: dict[str, Any] = {"refused": [], "raised": None}
    for step in range(STEPS):
        if step == BAD and case is None:
            continue
        trap.case = what if step == BAD and what != "nan_input" else None
        nan = step == BAD and what == "nan_input"
        try:
            trap.loss(model(x[step, mine] * (float("nan") if nan else 1.0)), y[step, mine]).backward()
        except (BadBatch, NonFiniteGradientError) as exc:
            out["raised"] = type(exc).__name__
            trap.case = None
            for _ in range(2 if elastic else 0):  # a commit would keep the changed residuals: refused
                try:  # before opt.zero_grad() (the model notices the raised backward) and after it
                    opt.end_step(step + 1)
                except StrategyError as exc:
                    out["refused"].append(("commit", str(exc)))
                opt.zero_grad()
            opt.zero_grad()
            continue
        except StrategyError as exc:  # refused until clear_state() when some buffer went through Ok-Topk
            out["refused"].append(("reduction", str(exc)))
            model.gradient_reducer.clear_state()
            opt.zero_grad()
            trap.loss(model(x[step, mine]), y[step, mine]).backward()  # this batch again
        opt.step()
        opt.zero_grad()
        if elastic:
            opt.end_step(step + 1)
    out["state"] = model.full_state_dict()
    return out


def _reference(backend: CommunicationBackend, name: str, restart: bool) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, BATCH)
    model = wrap(name, make_module(), backend, **_options(name))
    compressor = OkTopk(density=0.3, warmup_steps=1, tau=2, tau_prime=2)
    opt = GradientCompressionOptimizer(optimizer_for(name, model, "sgd"), compressor, dense_below=0)
    mine = slice(2 * backend.rank, 2 * backend.rank + 2)
    for step in range(STEPS):
        if step == BAD:
            if restart:
                model.gradient_reducer.clear_state()
            continue
        nn.functional.mse_loss(model(x[step, mine]), y[step, mine]).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_caught_exception_under_ok_topk_skips_the_batch(name: str, case: str) -> None:
    refused = case == "backward_partway"
    want = run_world(2, _reference, name, refused, timeout=30)
    for rank, res in enumerate(run_world(2, _train, name, case, timeout=30)):
        err = max_rel_error(res["state"], want[rank])
        assert err <= 1e-6, f"{name} {case} rank {rank}: off by {err:.3g}"
        assert res["raised"] == ("NonFiniteGradientError" if case == "nonfinite" else "BadBatch")
        assert [w for w, _ in res["refused"]] == (["reduction"] if refused else []), res["refused"]
        for _, msg in res["refused"]:
            assert "clear_state()" in msg and "checkpoint" in msg, msg


def test_an_elastic_commit_of_changed_residuals_is_refused() -> None:
    want = run_world(2, _reference, "ddp", True, timeout=30)
    for rank, res in enumerate(run_world(2, _train, "ddp", "backward_partway", True, timeout=30)):
        assert [w for w, _ in res["refused"]] == ["commit", "commit", "reduction"], res["refused"]
        assert all("clear_state()" in m for _, m in res["refused"]), res["refused"]
        err = max_rel_error(res["state"], want[rank])
        assert err <= 1e-6, f"rank {rank}: off by {err:.3g}"
