"""fp16 loss scaling that every rank agrees on: ``DynamicLossScaler`` (torch ``GradScaler``'s rule; the
Trainer's) and :class:`GradScaler`, torch's ``torch.amp.GradScaler`` calls over an optimizer strategy.

The loss is multiplied by ``scale`` before backward. The finite check of the gradients is the optimizer
strategy's ``grads_are_finite()``, a consensus over every rank of the mesh and every shard, so an
overflow anywhere skips the step on every rank and every rank lowers the same scale; after
``growth_interval`` applied steps in a row the scale grows. The gradients are divided by the scale
before clipping and the optimizer step. The scale is a float32 value, updated as torch updates it.

torch's own ``GradScaler`` checks ``param.grad`` on this rank only: under ZeRO-2/3, FSDP (ZeRO-1 with
reduce-scatter), tensor or pipeline parallelism that is a shard, a piece or one stage's gradients, so
ranks would disagree; those gradients' stand-ins refuse it, naming :class:`GradScaler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.compression.reducer import CompressedReducer
from dtlab.errors import ArgumentError, StrategyError, check_switches
from dtlab.models.base import OptimizerTarget
from dtlab.optimizers.base import OptimizerStrategy

__all__ = ["DynamicLossScaler", "GradScaler", "refuse_float16", "times_scale"]


def _f32(value: float) -> float:
    """``value`` rounded to float32, as torch keeps its scale."""
    return float(torch.tensor(value, dtype=torch.float32))


def times_scale(outputs: torch.Tensor, factor: float) -> torch.Tensor:
    """``outputs * factor`` as torch's ``GradScaler.scale`` multiplies: by a float32 (float64 for a
    float64 output) 0-dim tensor, so a 0-dim float16/bfloat16 loss is scaled in float32 (type
    promotion), not past float16's range (a loss of 1.5 at the scale 65536 would be inf: a non-finite
    loss rather than an overflow to back off from)."""
    dtype = torch.promote_types(outputs.dtype, torch.float32)
    return outputs * torch.full((), factor, dtype=dtype, device=outputs.device)


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    overflows: int = 0

    def update(self, overflow: bool) -> None:
        """After every step's (agreed) finite check: torch's ``_amp_update_scale_``."""
        if overflow:
            self.scale = _f32(self.scale * self.backoff_factor)
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            self.scale = grown if math.isfinite(grown) else self.scale
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.overflows = int(state["good_steps"]), int(state["overflows"])


class GradScaler:
    """``torch.amp.GradScaler``'s loop for a dtlab optimizer strategy, on every strategy and mesh::

        scaler = GradScaler("cuda", init_scale=2.0**16)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)              # agreed overflow check, gradients divided by the scale
        opt.clip_grad_norm_(max_norm)     # the global norm of the unscaled gradients
        scaler.step(opt)                  # skipped on every rank after an overflow on any
        scaler.update()

    Arguments and ``state_dict()`` are torch's (the scale is kept on the host: ``device`` is accepted
    for torch's signature); ``enabled=False`` makes every call a pass-through."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        check_switches("GradScaler", enabled=enabled)
        if not (init_scale > 0 and growth_factor > 1.0 and 0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ArgumentError(
                f"GradScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                f"{backoff_factor}, growth_interval={growth_interval}): needs init_scale > 0, "
                "growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1"
            )
        self.device, self._enabled = device, enabled
        self.scaler = DynamicLossScaler(_f32(init_scale), growth_factor, backoff_factor, int(growth_interval))
        #: this step's agreed overflow per optimizer (``id``), once unscaled; the optimizers stepped
        self._found_inf: dict[int, bool] = {}
        self._stepped: set[int] = set()
        #: the optimizers whose parameters were checked (none float16, on every rank)
        self._checked: set[int] = set()

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self.scaler.scale if self._enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list or tuple of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return times_scale(outputs, self.scaler.scale)
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ArgumentError(
            f"GradScaler.scale() takes a tensor or a list or tuple of them, got {type(outputs)}"
        )

    def unscale_(self, optimizer: OptimizerStrategy) -> None:
        """Check every rank's synchronized gradients (one consensus over the mesh) and divide them by the
        scale: once per step, after the last backward, before clipping with ``opt.clip_grad_norm_``."""
        if not self._enabled:
            return
        target, key = _target(optimizer), id(optimizer)
        if key in self._found_inf or key in self._stepped:
            by = "step(opt)" if key in self._stepped else "unscale_(opt)"
            raise StrategyError(
                f"GradScaler.unscale_(opt) after {by} since the last update(): call it once per step, after "
                "the last backward and before step(opt)"
            )
        if key not in self._checked:  # parameters' dtypes are fixed once wrapped: checked once
            refuse_float16(optimizer, target, "GradScaler.unscale_(opt)", _FIX)
            self._checked.add(key)
        self._found_inf[key] = not optimizer.grads_are_finite()
        target.scale_grads_(_f32(1.0 / self.scaler.scale))

    def step(self, optimizer: OptimizerStrategy, *args: Any, **kwargs: Any) -> Any:
        """``unscale_(optimizer)`` unless done, then ``optimizer.step()`` unless some rank's gradients
        overflowed (every rank skips alike). Returns what the step returns (None if skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if args or kwargs:
            raise StrategyError("GradScaler.step(opt) takes no closure: run forward and backward before it")
        if id(optimizer) in self._stepped:
            raise StrategyError("GradScaler.step(opt) was already called since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        return None if self._found_inf[id(optimizer)] else optimizer.step()

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Lower the scale after an overflow (on any rank, for any optimizer stepped), grow it after
        ``growth_interval`` steps without; or set ``new_scale``."""
        if not self._enabled:
            return
        if new_scale is not None:
            self.scaler.scale = _f32(float(new_scale))
        elif not self._found_inf:
            raise StrategyError(
                "GradScaler.update() before any unscale_(opt) or step(opt) since the last update()"
            )
        else:
            self.scaler.update(overflow=any(self._found_inf.values()))
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        """torch's keys (a torch ``GradScaler`` loads it, and this loads theirs); empty when disabled."""
        s = self.scaler
        if not self._enabled:
            return {}
        return {
            "scale": s.scale,
            "growth_factor": s.growth_factor,
            "backoff_factor": s.backoff_factor,
            "growth_interval": s.growth_interval,
            "_growth_tracker": s.good_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            raise StrategyError(
                "GradScaler.load_state_dict(): the state is empty (saved from a disabled scaler)"
            )
        s, get = self.scaler, state_dict.__getitem__
        s.scale, s.growth_factor, s.backoff_factor = (
            _f32(get("scale")),
            get("growth_factor"),
            get("backoff_factor"),
        )
        s.growth_interval, s.good_steps = int(get("growth_interval")), int(get("_growth_tracker"))


_FIX = (
    "Keep float32 parameters and compute under torch.autocast(device_type, dtype=torch.float16), or train "
    "bfloat16 parameters without a GradScaler"
)


def refuse_float16(optimizer: OptimizerStrategy, target: OptimizerTarget, who: str, fix: str) -> None:
    """torch's ``GradScaler.unscale_`` refuses float16 gradients ("Attempting to unscale FP16
    gradients"): unscaled in float16, the small values loss scaling kept underflow to zero. Agreed over
    every rank (a pipeline stage may hold float16 parameters where another does not); ``who`` is the
    caller, ``fix`` what to do instead."""
    half = [n for n, p in target.trainable_parameters() if p.dtype == torch.float16]
    if optimizer.agree(not half):
        return
    where = f"parameter {half[0]!r} is" if half else "another rank's parameters are"
    raise StrategyError(
        f"{who}: {where} float16, so its gradients would be unscaled in float16, where the small values "
        "loss scaling keeps underflow to zero (torch.amp.GradScaler refuses it too: 'Attempting to unscale "
        f"FP16 gradients'). {fix}"
    )


def _target(optimizer: object) -> OptimizerTarget:
    model = getattr(optimizer, "model", None) if isinstance(optimizer, OptimizerStrategy) else None
    if not isinstance(model, OptimizerTarget):
        raise StrategyError(
            f"dtlab.optimizers.GradScaler steps a dtlab optimizer strategy (DDPOptimizer, ZeRO1Optimizer, "
            f"ZeRO2Optimizer, ZeRO3Optimizer, or one wrapping them), got {type(optimizer).__name__}; a plain "
            "torch optimizer over a module's own parameters takes torch.amp.GradScaler"
        )
    if isinstance(model.gradient_reducer, CompressedReducer):
        raise StrategyError(
            "dtlab.optimizers.GradScaler with gradient compression: the compressors' error-feedback "
            "residuals would mix gradients of different loss scales; use bf16 autocast (no loss scaling) "
            "or no compression"
        )
    return model
