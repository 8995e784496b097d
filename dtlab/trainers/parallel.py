"""The model-parallel strategy a run plan asks for, and its loss.

With ``parallel.tp`` or ``parallel.pp`` above 1 the run plan (:func:`dtlab.parallel_config.run_plan`,
built once by the Trainer) is model-parallel: every rank builds the mesh it names and wraps the
embedded transformer (or your model) in
:meth:`HybridShardedModel.from_plan <dtlab.models.HybridShardedModel.from_plan>`: pipeline stages,
tensor-parallel layers in each (``parallel.plan``: the plan the model declares, or the one given),
``strategy.model`` over the dp axis. The default loss of a tensor-parallel model is its
``model.cross_entropy``: vocabulary-parallel where the logits stay split over tp (dtlab's
transformer), plain where the plan gathers them (Hugging Face's plans).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.plan import RunPlan
from dtlab.errors import ConfigError
from dtlab.models.base import ModelStrategy
from dtlab.trainers.embedded import logits_of

__all__ = ["build_parallel_model", "parallel_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_parallel_model(
    plan: RunPlan, backend: CommunicationBackend, module: nn.Module, dp_kwargs: dict[str, Any]
) -> ModelStrategy:
    """The composition ``plan`` describes over ``module`` (collective: every rank of ``backend`` calls
    it); ``dp_kwargs``: the data-parallel strategy's options (``trainers/build.py``). Activation
    checkpointing without a pipeline was applied per block by the caller."""
    from dataclasses import replace

    from dtlab.models import HybridShardedModel

    if plan.pp == 1:  # per block, done by the caller: the composition checkpoints pipeline stages only
        plan = replace(plan, activation_checkpointing=False)
    return HybridShardedModel.from_plan(module, backend, plan, **dp_kwargs)


def parallel_loss(model: ModelStrategy, loss_fn: LossFn, default: LossFn, tp: int) -> LossFn:
    """The loss the Trainer uses: a tensor-parallel model's vocabulary-parallel cross entropy in place of
    the embedded tasks' cross entropy; a custom ``Task.loss_fn`` is refused at tp > 1 (it would see
    logits split over tp)."""
    parallel_ce = getattr(model, "cross_entropy", None)
    if parallel_ce is None:
        return loss_fn
    if loss_fn is not default:
        if tp > 1 and getattr(model, "logits_split", True):
            raise ConfigError(
                f"parallel.tp={tp} with a custom Task.loss_fn: this tensor-parallel model's logits are split "
                "over tp (its loss is model.cross_entropy, the vocabulary-parallel cross entropy); use the "
                "default loss, gather the output layer's logits in the plan (style 'colwise_gather_output' "
                "in parallel.plan), or parallel.tp=1"
            )
        return loss_fn

    def ce(output: Any, targets: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = parallel_ce(logits_of(output), targets)  # a Hugging Face output: its logits
        return loss

    return ce
