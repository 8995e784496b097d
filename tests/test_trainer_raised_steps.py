"""The Trainer when a step raises on every rank (the user's loss function, the forward, a custom
autograd Function in backward): the Trainer catches nothing, so the exception leaves ``fit()`` on every
rank, with the data position past the bad batch and the step not counted. Calling ``fit()`` again goes
on (each step starts with ``opt.zero_grad()``, which drops a raised backward's partial gradients) and
equals a run in which that batch's loss was NaN and the Trainer's non-finite guard skipped the step;
metrics are still written. Under Ok-Topk, after a backward that raised once a compressed bucket was
reduced, the next fit() stops at its first step with the reducer's refusal naming clear_state() (that
step's batch is consumed too); after it, fit() goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from raised_cases import BadBatch, Trap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import load_config
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.testing import run_world
from dtlab.trainers import Trainer

STEPS, BAD = 4, 1  # the second step raises (in the raise runs: one fit() more)
BASE = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "train.eval_every=0"]
BASE += ["data.global_batch_size=16", "optimizer.warmup_steps=0", "optimizer.schedule=constant"]
BASE += ["optimizer.name=adamw", "optimizer.lr=0.01", "logging.log_every=1", "data.shuffle=false"]


# Ok-Topk with two buckets: the last two layers (2177 values, compressed) and the first
OKTOPK = ["compression.algorithm=oktopk", "compression.density=0.3", "compression.dense_warmup_steps=1"]
OKTOPK += ["compression.tau=2", "compression.tau_prime=2", "strategy.bucket_cap_mb=0.00831"]


def _fit(b: CommunicationBackend, strategy: str, case: str, run_dir: str, *extra: str) -> dict[str, Any]:
    """``case``: 'nan' (the reference: step BAD's loss is NaN, the guard skips it), or how step BAD
    raises ('loss', 'backward_function'); the raising runs call fit() again after the exception."""
    steps = STEPS + 1 if case == "nan" else STEPS
    cfg = load_config(
        overrides=[
            *BASE,
            f"train.steps={steps}",
            f"strategy.model={strategy}",
            f"logging.run_dir={run_dir}",
            *extra,
        ]
    )
    x = torch.linspace(-1, 1, 128)[:, None].repeat(1, 4) * torch.tensor([1.0, -0.5, 0.3, 2.0])
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    trap, calls = Trap(), [0]

    def build() -> nn.Module:
        with seeded_init(7):
            module = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 64), nn.Linear(64, 1))
        module[1].register_forward_hook(trap.after_block)
        return module

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, target)
        if not out.requires_grad:  # the Trainer's probe of the model and loss, before training
            return loss
        step = calls[0]
        calls[0] += 1
        trap.case = case if step + 1 == BAD else None  # the next forward's
        if step == BAD and case == "nan":
            return loss * float("nan")
        if step == BAD and case == "loss":
            raise BadBatch("a NaN check in the loss")
        return loss

    trainer = Trainer(cfg, b, model=build, train_data=data, loss_fn=loss_fn)
    out: dict[str, Any] = {"raised": None}
    try:
        trainer.fit()
    except BadBatch:
        out["raised"] = trainer.step  # the step it raised in is not counted
        trap.case = None
        try:
            again = trainer.fit()
        except StrategyError as exc:  # a compressed bucket was reduced: its residuals changed
            out["refused"] = str(exc)
            trainer.model.gradient_reducer.clear_state()  # the fix the error names
            again = trainer.fit()
        out["again"] = (again.start_step, again.final_step, again.summary["steps"])
    out["step"] = trainer.step
    out["state"] = trainer.model.full_state_dict()
    out["skipped"] = list(trainer.guard.skipped_steps)
    return out


def _logged_steps(run_dir: Path) -> list[int]:
    lines = [json.loads(s) for p in run_dir.rglob("metrics.jsonl") for s in p.read_text().splitlines()]
    return sorted(r["step"] for r in lines if "loss" in r)


@pytest.mark.parametrize("case", ["forward", "loss", "backward_function"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fit_again_after_a_raised_step_equals_the_guard_skipping_it(
    strategy: str, case: str, tmp_path: Path
) -> None:
    want = run_world(2, _fit, strategy, "nan", str(tmp_path / "ref"), timeout=60)
    assert want[0]["skipped"] == [BAD + 1] and want[0]["raised"] is None
    got = run_world(2, _fit, strategy, case, str(tmp_path / "run"), timeout=60)
    for rank, res in enumerate(got):
        assert res["raised"] == BAD and res["step"] == STEPS and "refused" not in res, res
        assert res["again"] == (BAD, STEPS, f"{BAD} -> {STEPS}"), res["again"]  # what the second fit() ran
        for k, v in want[rank]["state"].items():
            assert torch.allclose(res["state"][k], v, rtol=1e-5, atol=1e-7), (strategy, case, rank, k)
    assert _logged_steps(tmp_path / "run") == list(range(1, STEPS + 1))  # the second fit() logged too


def test_fit_again_after_a_compressed_backward_raised_partway_is_refused_until_clear_state(
    tmp_path: Path,
) -> None:
    for res in run_world(2, _fit, "ddp", "backward_function", str(tmp_path), *OKTOPK, timeout=60):
        assert "clear_state()" in res["refused"], res["refused"]
        assert res["raised"] == BAD and res["step"] == STEPS and res["again"][:2] == (BAD, STEPS), res
