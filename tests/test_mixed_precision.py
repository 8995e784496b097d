"""Mixed precision: the policy object, fp16 dynamic loss scaling agreed by every rank under every
data-parallel strategy (an overflow on one rank skips the step everywhere and halves the scale), a
float16 loss scaled as torch scales it, and float16 gradient averages that fit float16's range."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_strategies_helpers import OPTIMIZERS, STRATEGIES, optimizer_for, wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import load_config
from dtlab.errors import ConfigError, StrategyError
from dtlab.models.precision import MixedPrecisionPolicy
from dtlab.testing import run_world
from dtlab.trainers import Trainer


def test_policy_from_the_config_names() -> None:
    p = MixedPrecisionPolicy.from_names("fp16", "fp32")
    assert (p.param_dtype, p.reduce_dtype, p.output_dtype) == (torch.float16, torch.float32, None)
    assert MixedPrecisionPolicy.from_names("fp32") == MixedPrecisionPolicy()
    with p.autocast("cpu"):
        assert nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float16
    fp32_out = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32)
    assert fp32_out.cast_output(torch.zeros(2, dtype=torch.float16)).dtype == torch.float32
    assert p.cast_output(torch.zeros(2, dtype=torch.float16)).dtype == torch.float16
    with pytest.raises(ConfigError, match="error-feedback residuals would mix"):
        load_config(overrides=["train.precision=fp16", "compression.algorithm=topka"])


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1e6  # past fp16's range (65504) at the default loss scale


class Spiky(nn.Module):
    """Identity; when ``armed``, its next backward multiplies the gradient by 1e6."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            return _Spike.apply(x)  # type: ignore[no-any-return]
        return x


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), Spiky(), nn.ReLU(), nn.Linear(16, 2))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())


def _fp16_run(backend: CommunicationBackend, strategy: str, run_dir: str = "null") -> dict[str, Any]:
    sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false"]
    sets += [f"logging.run_dir={run_dir}"]
    sets += ["data.global_batch_size=8", "train.eval_every=0", "train.steps=4", "train.precision=fp16"]
    sets += [f"strategy.model={strategy}", "strategy.persistence_threshold=0", "strategy.reduce_dtype=fp32"]
    trainer = Trainer(
        load_config(overrides=sets), backend, model=_net, train_data=_data(), loss_fn="cross_entropy"
    )
    seen: list[int] = []
    step = trainer.train_step

    def arm_on_rank1_at_step2() -> tuple[bool, float | None, float | None]:
        seen.append(trainer.step + 1)
        if backend.rank == 1 and trainer.step + 1 == 2:
            trainer.model.module[1].armed = True
        return step()

    trainer.train_step = arm_on_rank1_at_step2  # type: ignore[method-assign]
    res = trainer.fit()
    assert trainer.scaler is not None
    return {
        "applied": [s for s, _ in res.losses],
        "overflow": trainer.overflow_steps,
        "scale": trainer.scaler.scale,
        "skipped_nonfinite": res.skipped_steps,
        "params": trainer.model.full_state_dict(),
    }


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(strategy: str, tmp_path: Path) -> None:
    r0, r1 = run_world(2, _fp16_run, strategy, str(tmp_path), timeout=120)
    for r in (r0, r1):
        assert r["applied"] == [1, 3, 4] and r["overflow"] == [2], r
        assert r["scale"] == 2.0**15 and r["skipped_nonfinite"] == []  # not counted as a NaN step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [(rec["step"], rec["skipped"]) for rec in records if "skipped" in rec]
    assert len(skipped) == 1 and skipped[0][0] == 2 and "fp16 gradients overflowed" in skipped[0][1]
    for k, v in r0["params"].items():
        assert torch.equal(v, r1["params"][k]), k  # the ranks still agree
        assert torch.isfinite(v).all()


def _fp16_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A user's loss in the output's dtype (float16 under fp16 autocast), about 1.5."""
    return (out - nn.functional.one_hot(y, 2).to(out.dtype)).abs().mean() + 1


def _loss_dtype_run(backend: CommunicationBackend, as_float32: bool) -> tuple[list[int], dict[str, Any]]:
    sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
    sets += ["data.global_batch_size=8", "train.eval_every=0", "train.steps=3", "train.precision=fp16"]
    loss = (lambda out, y: _fp16_loss(out, y).float()) if as_float32 else _fp16_loss
    trainer = Trainer(load_config(overrides=sets), backend, model=_net, train_data=_data(), loss_fn=loss)
    trainer.fit()
    return trainer.overflow_steps, trainer.model.full_state_dict()


def test_a_float16_loss_is_scaled_as_torch_s_grad_scaler_scales_it() -> None:
    """A 0-dim float16 loss times the scale is float32 (torch's GradScaler multiplies by a float32
    tensor): the same steps as the loss cast to float32 (step 1 overflows in backward, where the scale
    65536 reaches float16), not an inf loss at every step until the non-finite guard stops the run."""
    fp16_runs, fp32_runs = (run_world(2, _loss_dtype_run, f32, timeout=120) for f32 in (False, True))
    for (skipped, got), (want_skipped, want) in zip(fp16_runs, fp32_runs, strict=True):
        assert skipped == want_skipped == [1]
        assert all(torch.equal(got[k], want[k]) for k in want)


def _near_fp16_max(backend: CommunicationBackend, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One SGD step of a zero Linear in ``dtype`` whose weight gradients are 48000 on rank 0 and
    32000 on rank 1 (both in float16's range, their sum 80000 is not), reduced in float16."""
    module = nn.Linear(4, 2, bias=False).to(dtype)
    nn.init.zeros_(module.weight)
    reduce_dtype = torch.float16 if dtype != torch.float16 else None
    model = wrap(name, module, backend, reduce_dtype=reduce_dtype)
    opt = optimizer_for(name, model, "sgd_plain")
    x = torch.full((1, 4), (48000.0, 32000.0)[backend.rank], dtype=dtype)
    model(x).sum().backward()
    opt.step()
    return model.full_state_dict()["weight"]


def test_float16_gradients_are_divided_before_they_are_summed() -> None:
    """float16 parameters, or reduce_dtype=float16, under every strategy: the average 40000 as one
    process gives it (torch DDP divides by the world size before the sum), not inf."""
    for dtype in (torch.float16, torch.float32):
        want = nn.Linear(4, 2, bias=False).to(dtype)
        nn.init.zeros_(want.weight)
        x = torch.tensor([[48000.0] * 4, [32000.0] * 4], dtype=dtype)
        (want(x).sum() / 2).backward()
        torch.optim.SGD(want.parameters(), lr=OPTIMIZERS["sgd_plain"][1]["lr"]).step()
        for name in STRATEGIES:
            for got in run_world(2, _near_fp16_max, name, dtype, timeout=60):
                assert torch.equal(got, want.weight.detach()), (name, dtype, got)


def _half_model_run(backend: CommunicationBackend, strategy: str) -> str:
    sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
    sets += ["data.global_batch_size=8", "train.eval_every=0", "train.steps=2", "train.precision=fp16"]
    sets += [f"strategy.model={strategy}"]
    data = _data()
    half = torch.utils.data.TensorDataset(data.tensors[0].half(), data.tensors[1])
    try:
        Trainer(load_config(overrides=sets), backend, model=lambda: _net().half(), train_data=half)
    except StrategyError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_fp16_with_a_float16_model_is_refused_as_torch_s_grad_scaler_does(strategy: str) -> None:
    """A model built in float16 would have its gradients unscaled in float16 (underflow): refused on
    every rank before any step, naming the parameter and the fix, as GradScaler refuses it."""
    for text in run_world(2, _half_model_run, strategy, timeout=60):
        assert "train.precision=fp16: parameter '0.weight' is float16" in text, text
        assert "float32" in text and "train.precision=bf16" in text, text
