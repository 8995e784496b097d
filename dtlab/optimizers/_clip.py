"""Clipping by the global gradient norm for the data-parallel optimizer strategies: torch's
``clip_grad_norm_`` (its arguments and results) over the gradients as a strategy holds them, whole or
as this rank's shard, summed over the ranks that partition them."""

from __future__ import annotations

import math

import torch

from dtlab.backends.base import ReduceOp
from dtlab.models.base import OptimizerTarget

__all__ = ["clip_by_global_norm", "clip_by_value"]


def _global_norm(model: OptimizerTarget, norm_type: float) -> torch.Tensor:
    tensors, replicated = model.norm_grad_tensors()
    device = model.dp_backend.device
    if math.isinf(norm_type):  # torch.max propagates a NaN (Python's max() keeps whichever came first)
        maxima = [t.detach().abs().max().double() for t in tensors if t.numel()]
        local = torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float64, device=device)
        nan = torch.isnan(local)  # carried apart: a backend's MAX need not propagate NaN
        total = torch.stack([torch.where(nan, torch.inf, local), nan.double()]).to(device)
        if not replicated:
            model.grad_norm_group().all_reduce(total, ReduceOp.MAX)
        return torch.where(total[1] > 0, torch.nan, total[0])
    acc = torch.zeros(1, dtype=torch.float64, device=device)
    for t in tensors:
        if t.numel():
            acc += t.detach().double().abs().pow(norm_type).sum()
    if not replicated:
        model.grad_norm_group().all_reduce(acc, ReduceOp.SUM)
    return acc[0].pow(1.0 / norm_type)


def clip_by_global_norm(
    model: OptimizerTarget, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """Scale ``model``'s synchronized gradients by ``max_norm / (norm + 1e-6)`` where that is below 1
    (as torch: a NaN norm makes them NaN) and return the global norm (float64 for a model with float64
    parameters, else float32); ``error_if_nonfinite``: torch's RuntimeError instead when the norm is
    NaN or infinite (the same norm, so on every rank)."""
    if not (isinstance(max_norm, int | float) and max_norm > 0):
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    norm = _global_norm(model, norm_type)
    value = float(norm)
    if error_if_nonfinite and not math.isfinite(value):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    coef = float(max_norm) / (value + 1e-6)
    if not (coef >= 1.0):  # NaN too: torch multiplies by the clamped coefficient, NaN included
        model.scale_grads_(coef)
    wide = any(p.dtype == torch.float64 for _, p in model.trainable_parameters())
    return norm if wide else norm.float()  # torch's is the gradients' dtype: float64 kept whole


def _held_grads(model: OptimizerTarget) -> list[torch.Tensor]:
    """Every synchronized gradient this rank steps, whole or its shard. A composition's norm parts
    count a tensor held on several ranks once (replicated over tp on tp rank 0, over dp under DDP on
    dp rank 0, a weight tied across stages on one stage), so its data-parallel strategy's are read."""
    inner = getattr(model, "dp_strategy", None)
    return (inner if isinstance(inner, OptimizerTarget) else model).norm_grad_tensors()[0]


def clip_by_value(model: OptimizerTarget, clip_value: float) -> None:
    """Clamp every synchronized gradient to ``[-clip_value, clip_value]`` (torch's
    ``clip_grad_value_`` on the gradients as the strategy holds them: whole or this rank's shard)."""
    if not (isinstance(clip_value, int | float) and clip_value > 0):
        raise ValueError(f"clip_value must be a number > 0, got {clip_value!r}")
    tensors = _held_grads(model)
    with torch.no_grad():
        for t in tensors:
            t.clamp_(-float(clip_value), float(clip_value))
