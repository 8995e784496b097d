"""The mesh and the model-parallel strategy a config's ``parallel`` section asks for.

With ``parallel.tp`` or ``parallel.pp`` above 1 (or ``strategy.model`` tensor, pipeline or hybrid) every
rank builds ``Mesh(backend, {"pp": pp, "dp": dp, "tp": tp})`` and wraps the embedded transformer:
``tensor`` -> :class:`~dtlab.models.TensorParallelModel` (built-in plan), ``pipeline`` ->
:class:`~dtlab.models.PipelineParallelModel`, a data-parallel name (ddp, zero1, zero2, zero3, fsdp) or
``hybrid`` -> :class:`~dtlab.models.HybridShardedModel`: pipeline stages, tensor-parallel layers in
each, that data-parallel strategy over the dp axis. The loss of a tensor-parallel model is its
vocabulary-parallel cross entropy (``model.cross_entropy``): the logits stay split over tp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig
from dtlab.core import pairs
from dtlab.errors import ConfigError
from dtlab.models.base import ModelStrategy
from dtlab.parallel_config import MESH_STRATEGIES
from dtlab.trainers.tasks import logits_of

__all__ = ["build_parallel_model", "data_parallel_choice", "mesh_shape", "needs_mesh", "parallel_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def needs_mesh(config: TrainConfig) -> bool:
    """Whether the run is model-parallel (a mesh of pp x dp x tp ranks)."""
    return config.parallel.model_parallel or config.strategy.model in MESH_STRATEGIES


def mesh_shape(config: TrainConfig, world_size: int) -> dict[str, int]:
    """``{"pp": .., "dp": .., "tp": ..}`` for a world of ``world_size`` ranks (outermost first)."""
    par = config.parallel
    return {"pp": par.pp, "dp": par.dp_size(world_size), "tp": par.tp}


def data_parallel_choice(config: TrainConfig) -> str:
    """The data-parallel strategy on the dp axis: ``strategy.model`` for ddp, zero1, zero2, zero3 and
    fsdp; for ``strategy.model=hybrid`` the optimizer's (``ddp``, ``zero1``, ``zero2``, ``zero3``); for
    tensor and pipeline, whose dp axis runs DDP buckets, the optimizer's too (``ddp`` or ``zero1``)."""
    name = config.strategy.model
    return name if name in pairs.DATA_PARALLEL else config.strategy.optimizer_name


def build_parallel_model(
    config: TrainConfig, backend: CommunicationBackend, module: nn.Module, dp_kwargs: dict[str, Any]
) -> ModelStrategy:
    """The model-parallel strategy over ``module`` (collective: every rank of ``backend`` calls it);
    ``dp_kwargs``: the data-parallel strategy's options (``trainers/build.py``)."""
    from dtlab.backends import Mesh
    from dtlab.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel, transformer_plan

    par, s = config.parallel, config.strategy
    mesh = Mesh(backend, mesh_shape(config, backend.world_size))
    plan = transformer_plan(sequence_parallel=par.sequence_parallel)
    pipeline: dict[str, Any] = {
        "schedule": par.schedule,
        "micro_batches": par.micro_batch_count,
        "split_points": par.split_points,
        "stages_per_rank": par.stages_per_rank,
    }
    if s.activation_checkpointing and par.pp > 1:
        pipeline["activation_checkpointing"] = True  # per stage: its input kept, its forward recomputed
    elif s.activation_checkpointing:  # tensor parallel: per block, its collectives run again in backward
        from dtlab.models.checkpointing import checkpoint_modules
        from dtlab.zoo import Block

        checkpoint_modules(module, (Block,))
    if s.model == "tensor":  # dp_kwargs: the optimizer's data-parallel options (ddp or zero1)
        return TensorParallelModel(module, mesh, tensor_plan=plan, **dp_kwargs)
    if s.model == "pipeline":
        return PipelineParallelModel(module, mesh, **pipeline, **dp_kwargs)
    if par.pp == 1:
        pipeline = {}  # without a pipeline the steps are not micro-batched (data.accumulation_steps is)
    choice = data_parallel_choice(config)
    return HybridShardedModel(
        module,
        mesh,
        data_parallel=choice,
        tensor_plan=plan if par.tp > 1 else None,
        **pipeline,
        **dp_kwargs,
    )


def parallel_loss(model: ModelStrategy, loss_fn: LossFn, default: LossFn, tp: int) -> LossFn:
    """The loss the Trainer uses: a tensor-parallel model's vocabulary-parallel cross entropy in place of
    the embedded tasks' cross entropy; a custom ``Task.loss_fn`` is refused at tp > 1 (it would see
    logits split over tp)."""
    parallel_ce = getattr(model, "cross_entropy", None)
    if parallel_ce is None:
        return loss_fn
    if loss_fn is not default:
        if tp > 1:
            raise ConfigError(
                f"parallel.tp={tp} with a custom Task.loss_fn: a tensor-parallel model's logits are split "
                "over tp (its loss is model.cross_entropy, the vocabulary-parallel cross entropy); use the "
                "embedded task's loss or parallel.tp=1"
            )
        return loss_fn

    def ce(output: Any, targets: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = parallel_ce(logits_of(output), targets)  # a Hugging Face output: its logits
        return loss

    return ce
