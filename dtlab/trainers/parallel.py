"""The mesh and the model-parallel strategy a config's ``parallel`` section asks for.

With ``parallel.tp`` or ``parallel.pp`` above 1 (or ``strategy.model`` tensor, pipeline or hybrid) every
rank builds ``Mesh(backend, {"pp": pp, "dp": dp, "tp": tp})`` and wraps the embedded transformer:
``tensor`` -> :class:`~dtlab.models.TensorParallelModel` (built-in plan), ``pipeline`` ->
:class:`~dtlab.models.PipelineParallelModel`, a data-parallel name (ddp, zero1, ...) or ``hybrid`` ->
the composition of the three over the mesh. The loss of a tensor-parallel model is its vocabulary-parallel
cross entropy (``model.cross_entropy``): the logits stay split over tp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig
from dtlab.errors import ConfigError
from dtlab.models.base import ModelStrategy
from dtlab.parallel_config import MESH_STRATEGIES

__all__ = ["build_parallel_model", "mesh_shape", "needs_mesh", "parallel_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def needs_mesh(config: TrainConfig) -> bool:
    """Whether the run is model-parallel (a mesh of pp x dp x tp ranks)."""
    return config.parallel.model_parallel or config.strategy.model in MESH_STRATEGIES


def mesh_shape(config: TrainConfig, world_size: int) -> dict[str, int]:
    """``{"pp": .., "dp": .., "tp": ..}`` for a world of ``world_size`` ranks (outermost first)."""
    par = config.parallel
    return {"pp": par.pp, "dp": par.dp_size(world_size), "tp": par.tp}


def build_parallel_model(
    config: TrainConfig, backend: CommunicationBackend, module: nn.Module
) -> ModelStrategy:
    """The model-parallel strategy over ``module`` (collective: every rank of ``backend`` calls it)."""
    from dtlab.backends import Mesh
    from dtlab.models import PipelineParallelModel, TensorParallelModel, transformer_plan

    par, s = config.parallel, config.strategy
    name = s.model
    mesh = Mesh(backend, mesh_shape(config, backend.world_size))
    plan = transformer_plan(sequence_parallel=par.sequence_parallel)
    sync: Any = s.gradient_sync if s.optimizer_name == "zero1" else None
    if name == "tensor" or (name in ("ddp", "zero1") and par.pp == 1):
        return TensorParallelModel(module, mesh, plan=plan, gradient_sync=sync, bucket_cap_mb=s.bucket_cap_mb)
    if name == "pipeline" or (name in ("ddp", "zero1") and par.tp == 1):
        return PipelineParallelModel(
            module,
            mesh,
            par.schedule,
            micro_batches=par.micro_batch_count,
            split_points=par.split_points,
            stages_per_rank=par.stages_per_rank,
            gradient_sync=sync,
            bucket_cap_mb=s.bucket_cap_mb,
        )
    raise ConfigError(
        f"strategy.model={name!r} with parallel.tp={par.tp} and parallel.pp={par.pp}: tensor and pipeline "
        "parallelism together, or with ZeRO-2/3 or FSDP, need the hybrid strategy; use strategy.model=ddp "
        "or zero1 with one of tp and pp"
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
    ce: LossFn = parallel_ce
    return ce
