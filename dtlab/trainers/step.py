"""One optimizer step of a :class:`~dtlab.trainers.Trainer`: this rank's micro-batches through
``model.train_step`` (``no_sync`` on all but the last, so gradients travel once; a pipeline runs its
schedule there), a consensus on finite losses and on finite gradients over every rank of the mesh, fp16
loss scaling, clipping by the global norm, the optimizer step and the LR schedule.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from dtlab.backends.base import ReduceOp
from dtlab.errors import ConfigError
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.optimizers.grad_scaler import DynamicLossScaler, times_scale
from dtlab.trainers.guard import NonFiniteGuard
from dtlab.trainers.labels import explain_loss_error
from dtlab.trainers.profiler import Profiler
from dtlab.trainers.rank_draws import RankDraws
from dtlab.trainers.run_view import ForwardRun
from dtlab.trainers.scheduler import LRSchedulerLike
from dtlab.trainers.token_mean import LossFn, TokenMean

__all__ = ["StepRun", "train_step"]


class StepRun(ForwardRun, Protocol):
    """What one optimizer step reads of a run (a Trainer is one): ``step`` is the last step done;
    the guard, the loss scaler and ``overflow_steps`` (fp16 steps skipped) are updated in place."""

    @property
    def optimizer(self) -> OptimizerStrategy: ...
    @property
    def scheduler(self) -> LRSchedulerLike: ...
    @property
    def scaler(self) -> DynamicLossScaler | None: ...
    @property
    def guard(self) -> NonFiniteGuard: ...
    @property
    def profiler(self) -> Profiler: ...
    @property
    def step(self) -> int: ...
    @property
    def overflow_steps(self) -> list[int]: ...
    @property
    def token_mean(self) -> TokenMean | None: ...
    @property
    def draws(self) -> RankDraws: ...


def _micro_step(trainer: StepRun, batch: Any, k: int, loss_fn: LossFn) -> float:
    """Forward and backward of one micro-batch through ``model.train_step`` (a pipeline runs its
    schedule there); the loss is divided by the accumulation steps before backward."""
    x, y = batch  # on this rank's device already (DataFeed)
    accum = trainer.config.data.accumulation_steps
    cast = trainer.precision.cast_output
    factor = (trainer.scaler.scale if trainer.scaler else 1.0) / accum

    def scaled(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        try:
            loss = loss_fn(cast(out), target)
        except (IndexError, RuntimeError) as exc:  # a target out of the output's range: named
            if trainer.config.parallel.tp > 1:  # a vocabulary-parallel loss sees a slice of the classes
                raise
            whole = target.shape[:1] == y.shape[:1]  # not a pipeline's chunk of the micro-batch
            rows = trainer.feed.step_indices(k) if whole else None
            named = explain_loss_error(out, target, trainer.backend.rank, rows, exc)
            if named is None:
                raise
            raise named from exc
        # a pipeline leaves out a micro-batch whose loss is constant (nothing to learn: its gradient is
        # zero), refusing on every rank only a step where every one's is; elsewhere backward would fail
        graphless = (
            isinstance(out, torch.Tensor) and out.requires_grad and not getattr(loss, "requires_grad", True)
        )
        if graphless and not getattr(trainer.model, "pipelined", False):
            raise ConfigError(  # else torch's "element 0 of tensors does not require grad" at backward
                "loss_fn returned a loss that does not depend on the model's output (detached, a constant "
                "or built from .item()); compute it from the output with torch operations"
            )
        return times_scale(loss, factor) if factor != 1.0 else loss

    with trainer.draws(), trainer.precision.autocast(trainer.backend.device.type):
        return float(trainer.model.train_step((x, y), scaled)) / (factor * accum)


def _set_to_none(trainer: StepRun) -> bool:
    """``zero_grad``'s ``set_to_none``: False under compression with ``find_unused_parameters``, so a
    parameter that had a gradient keeps being stepped, with its synchronized gradient (its
    error-feedback residual included), in a step no rank uses it; a skip would drop that residual (the
    compression optimizer refuses to). A parameter never used keeps no gradient and is left out."""
    c = trainer.config
    return not (c.compression.algorithm != "none" and c.strategy.find_unused_parameters)


def train_step(trainer: StepRun) -> tuple[bool, float | None, float | None]:
    """One optimizer step; returns (applied, mean loss over the dp group, global gradient norm); with
    the default loss, the mean over the global batch's counted targets (``trainers/token_mean.py``).

    Every rank runs every backward (a non-finite loss gives non-finite gradients, which the
    compressed reducer and the strategies pass on without sending them into any state); then one
    consensus on finite losses and one on finite gradients, over every rank of the mesh."""
    optimizer, profiler = trainer.optimizer, trainer.profiler
    tokens = trainer.token_mean
    with profiler.phase("data"):
        micro = trainer.feed.next_micro_batches()
        # the default loss: each call weighted by its share of the step's counted targets (over dp)
        loss_fn = trainer.loss_fn
        if tokens is not None:
            loss_fn = tokens.weighted(loss_fn, tokens.step_count(micro))
    optimizer.zero_grad(set_to_none=_set_to_none(trainer))
    local_loss = 0.0
    with profiler.phase("forward_backward"):
        for k, batch in enumerate(micro[:-1]):
            with trainer.model.no_sync():
                local_loss += _micro_step(trainer, batch, k, loss_fn)
        local_loss += _micro_step(trainer, micro[-1], len(micro) - 1, loss_fn)
        finite = optimizer.agree(math.isfinite(local_loss))
        loss_finite = finite
        if finite:
            finite = optimizer.grads_are_finite()
    scaler = trainer.scaler
    if scaler is not None and loss_finite:
        # fp16: gradients that overflowed on any rank or shard (agreed above) lower the scale on
        # every rank; the step is skipped everywhere, and not counted as a non-finite loss
        if not finite:
            scaler.update(overflow=True)
            optimizer.zero_grad(set_to_none=_set_to_none(trainer))
            trainer.overflow_steps.append(trainer.step + 1)
            return False, None, None
        unscale: Any = getattr(trainer.model, "scale_grads_")  # noqa: B009 (checked by the Trainer)
        unscale(1.0 / scaler.scale)
        scaler.update(overflow=False)
    trainer.guard.update(finite, trainer.step + 1)  # steps are counted from 1, like TrainResult.losses
    if not finite:
        optimizer.zero_grad(set_to_none=_set_to_none(trainer))
        return False, None, None
    with profiler.phase("optimizer"):
        norm = None
        clip = trainer.config.optimizer.clip_grad_norm
        if clip is not None:
            norm = float(optimizer.clip_grad_norm_(clip))
        optimizer.step()
        trainer.scheduler.step()
        dp = trainer.dp
        mean = torch.tensor([local_loss], dtype=torch.float64, device=dp.device)
        dp.all_reduce(mean, ReduceOp.SUM)
    return True, float(mean.item()) / dp.world_size, norm
