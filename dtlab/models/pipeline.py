"""Pipeline parallelism: the model split into stages over the mesh's ``pp`` axis, micro-batched.

``PipelineParallelModel(module, mesh, schedule="1f1b", micro_batches=8)`` splits ``module`` (an
``nn.Sequential`` or a module with ``pipeline_blocks()``, see :mod:`dtlab.models._pipeline_split`) into
``pp x stages_per_rank`` stages; rank ``r`` of the ``pp`` group runs stages ``r, r + pp, ...``.
``train_step((inputs, targets), loss_fn)`` runs one step's schedule (GPipe, 1F1B, interleaved 1F1B or
zero-bubble ZB-H1, built and dry-run as data at construction) on this rank's share of the batch and
returns the batch's mean loss on every pipeline rank. Each stage's gradients are then averaged over its
``dp`` group through the gradient reducer (DDP buckets; ``DDPOptimizer`` or ``ZeRO1Optimizer`` drive
it; compression swaps the reducer). Parameters of stages on other ranks are released (moved to the meta
device); ``self.module`` holds this rank's parameters under their names in ``module``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import Mesh
from dtlab.core.reducer import DenseReducer
from dtlab.errors import StrategyError
from dtlab.models._hybrid_sync import sync_buckets
from dtlab.models._pipeline_comm import StageLinks, infer_through_stages
from dtlab.models._pipeline_plot import plot_schedule
from dtlab.models._pipeline_runtime import StepResult, check_stage_checkpointing, run_schedule
from dtlab.models._pipeline_schedules import (
    SCHEDULES,
    Action,
    Kind,
    PipelineSchedule,
    Timeline,
    build_schedule,
    check_schedule_args,
    dry_run,
    simulate,
)
from dtlab.models._pipeline_split import (
    Stage,
    TensorSpec,
    local_tree,
    module_blocks,
    split_blocks,
    stage_specs,
)
from dtlab.models._pipeline_zb import defer_weight_gradient, weight_gradient_queue
from dtlab.models.zero1 import GradientSync, ZeRO1Model, gradient_sync_for

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "PipelineParallelModel",
    "PipelineSchedule",
    "Timeline",
    "build_schedule",
    "check_schedule_args",
    "defer_weight_gradient",
    "dry_run",
    "plot_schedule",
    "simulate",
    "weight_gradient_queue",
]


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"PipelineParallelModel takes a dtlab.backends.Mesh, got {type(mesh).__name__}")
    names = mesh.axis_names
    if "pp" not in names:
        raise StrategyError(f"PipelineParallelModel needs a mesh with a 'pp' axis, got axes {list(names)}")
    others = [a for a in names if a not in ("pp", "dp") and mesh.size(a) > 1]
    if others:
        raise StrategyError(
            f"PipelineParallelModel runs on the mesh axes 'pp' and 'dp'; axes {others} of size > 1 belong to "
            "other strategies (HybridShardedModel composes them)"
        )


class PipelineParallelModel(ZeRO1Model):
    """Stages over ``mesh["pp"]``, data parallelism over ``mesh["dp"]``.

    Args:
        module: the whole model, built alike on every rank (each stage's values come from its dp rank 0).
        mesh: a :class:`~dtlab.backends.Mesh` with a ``pp`` axis and optionally ``dp`` (a plain
            backend is taken as ``Mesh(backend, {"pp": backend.world_size})``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"`` (ZB-H1).
        micro_batches: micro-batches per step (default: the pp size); the batch must split evenly.
        split_points: block names where stages 1.. begin (default: balanced by parameter count).
        stages_per_rank: stages (chunks) per rank; > 1 only with ``"interleaved_1f1b"``.
        gradient_sync: dp averaging as for ZeRO1Model; None (default) lets the optimizer choose.
        bucket_cap_mb, reduce_dtype, broadcast_buffers: as for DDPModel (over the dp group).
    """

    strategy_name: ClassVar[str] = "pipeline"

    def __init__(
        self,
        module: nn.Module,
        mesh: Any,
        schedule: str = "1f1b",
        micro_batches: int | None = None,
        split_points: Sequence[str] | None = None,
        stages_per_rank: int = 1,
        *,
        gradient_sync: GradientSync | None = None,
        activation_checkpointing: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineParallelModel wraps a torch.nn.Module, got {type(module).__name__}")
        check_stage_checkpointing(activation_checkpointing, schedule, "PipelineParallelModel")
        self.activation_checkpointing = activation_checkpointing
        if isinstance(mesh, CommunicationBackend):  # a plain group: every rank one pipeline stage
            mesh = Mesh(mesh, {"pp": mesh.world_size})
        _check_mesh(mesh)
        pp: CommunicationBackend = mesh["pp"]
        p, v = pp.world_size, stages_per_rank
        m = p if micro_batches is None else micro_batches
        check_schedule_args(schedule, p, m, v)  # before any work, with the rule and the values
        blocks = module_blocks(module)
        all_stages = split_blocks(blocks, p * v, split_points)
        plan = build_schedule(schedule, p, m, v)  # dry-run: no deadlock, every message matched
        mine = plan.stages_of(pp.rank)
        keep = {id(t) for s in mine for t in list(all_stages[s].parameters()) + list(all_stages[s].buffers())}
        for s, stage in enumerate(all_stages):
            if s not in mine:
                stage.to("meta")  # release other ranks' stages; their shapes stay for the meta forward
        tree = local_tree(module, keep)
        if not any(q.requires_grad for q in tree.parameters()):
            raise StrategyError(
                f"pipeline rank {pp.rank} holds stages {list(mine)} "
                f"({', '.join(f'{all_stages[s].names[0]}..{all_stages[s].names[-1]}' for s in mine)}) with "
                "no trainable parameters; move the split points so every rank has some"
            )
        super().__init__(
            tree, mesh["dp"], gradient_sync=gradient_sync or "all_reduce", world=mesh.backend, **kwargs
        )
        self.mesh = mesh
        self.pp_group = pp
        self.schedule = plan
        self.micro_batches = m
        self._chosen_sync = gradient_sync
        self.__dict__["_user_module"] = module  # not registered: its other stages are on the meta device
        self._stages = all_stages
        self._mine = {s: all_stages[s] for s in mine}
        self._specs: dict[TensorSpec, list[TensorSpec]] = {}
        self._last: StepResult | None = None
        self._span = mesh.backend

    # ------------------------------------------------------------------ structure
    @property
    def stages(self) -> list[Stage]:
        """Every stage in order (those of other ranks hold meta tensors)."""
        return list(self._stages)

    def train(self, mode: bool = True) -> PipelineParallelModel:
        super().train(mode)
        for stage in self._stages:
            stage.train(mode)
        return self

    def _specs_for(self, sample: torch.Tensor) -> list[TensorSpec]:
        key = TensorSpec(tuple(sample.shape), sample.dtype)
        if key not in self._specs:
            self._specs[key] = stage_specs(self._stages, key)
        return self._specs[key]

    # ------------------------------------------------------------------ inference
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference through every stage (no autograd across ranks); the output on every pp rank.
        Training goes through :meth:`train_step`, which runs the schedule."""
        if self.training and torch.is_grad_enabled():
            raise StrategyError(
                "PipelineParallelModel trains through train_step((inputs, targets), loss_fn), which runs the "
                "pipeline schedule; forward() is inference only: call model.eval() or run it under "
                "torch.no_grad()"
            )
        stages = self._stages
        return infer_through_stages(
            x, lambda h, s: stages[s](h), self._specs_for(x), self.schedule, self.pp_group
        )

    # ------------------------------------------------------------------ training
    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One step's schedule on ``(inputs, targets)`` (every pp rank passes its dp share of the batch);
        gradients averaged over dp afterwards. Returns the batch's mean loss on every pp rank."""
        inputs, targets = batch
        m = self.micro_batches
        for what, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise StrategyError(
                    f"PipelineParallelModel.train_step: {what} must be a batched tensor, got {t!r}"
                )
            if t.shape[0] % m:
                raise StrategyError(
                    f"PipelineParallelModel.train_step: the batch of {t.shape[0]} samples ({what}) does not "
                    f"split into micro_batches={m} equal micro-batches; use a batch size that is a multiple "
                    f"of {m}"
                )
        if self._grad_state == "averaged":  # gradients kept from the last step: ZeRO-1's rescale
            self._scale_own_slices(float(self.dp_backend.world_size))
            self._grad_state = "rescaled"
        micro_in, micro_tg = inputs.chunk(m), targets.chunk(m)
        specs = self._specs_for(micro_in[0])
        links = StageLinks(self.pp_group, self.schedule, specs) if self.pp_group.world_size > 1 else None
        with self.no_sync():
            result = run_schedule(
                self.schedule,
                self.pp_group.rank,
                self._mine,
                links,
                micro_in,
                micro_tg,
                loss_fn,
                {t.untyped_storage().data_ptr() for t in [*self.module.parameters(), inputs, targets]},
                checkpointing=self.activation_checkpointing,
            )
        self._last = result
        self._synchronize()
        loss = torch.zeros(1, dtype=torch.float32, device=self.pp_group.device)
        if result.loss is not None:
            loss.copy_(result.loss.reshape(1))
        if self.pp_group.world_size > 1:
            self.pp_group.broadcast(loss, self.schedule.rank_of(self.schedule.num_stages - 1))
        return loss[0]

    def _synchronize(self) -> None:
        """Average every bucket over the dp group through the reducer (after the whole schedule)."""
        if self._grad_state == "rescaled":
            self._grad_state = "local"
        if self.dp_backend.world_size == 1 and type(self._reducer) is DenseReducer:
            # one replica: the average is the sum, already in the buckets (no 0-byte collectives)
            self._grad_state = "averaged" if self.gradient_sync == "reduce_scatter" else self._grad_state
            self._grads_synced = True
            return
        sync_buckets(self)

    def last_timeline(self) -> list[tuple[Action, float, float]]:
        """This rank's measured compute intervals of the last step (``perf_counter`` seconds)."""
        return [] if self._last is None else list(self._last.timeline)

    # ------------------------------------------------------------------ optimizer protocol
    def attach_optimizer(self, optimizer: Any) -> None:
        super().attach_optimizer(optimizer)
        self.gradient_sync = gradient_sync_for("PipelineParallelModel", self._chosen_sync, optimizer)

    def grad_norm_group(self) -> CommunicationBackend:
        """The norm's parts add up over every rank of the pp x dp mesh (stages hold different tensors)."""
        return cast(CommunicationBackend, self._span)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """This rank's part of the global norm: its stages' gradients once per dp group (dp rank 0 in
        all-reduce mode, each rank's own slice in reduce-scatter mode); summed over the mesh."""
        tensors, replicated = super().norm_grad_tensors()
        if replicated and self.dp_backend.rank != 0:
            tensors = []
        return tensors, False

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer keyed like the module's ``state_dict()``, on every pp rank
        (collective over pp: each tensor is broadcast from the rank holding its stage)."""
        module = self.__dict__["_user_module"]
        owner: dict[int, int] = {}
        for s, stage in enumerate(self._stages):
            for t in list(stage.parameters()) + list(stage.buffers()):
                owner[id(t)] = self.schedule.rank_of(s)
        pp, out = self.pp_group, {}
        for key, t in module.state_dict(keep_vars=True).items():
            src = owner[id(t)]
            if src == pp.rank:
                full = t.detach().clone().contiguous()
            else:
                full = torch.empty(t.shape, dtype=t.dtype, device=pp.device)
            if pp.world_size > 1:
                pp.broadcast(full, src)
            out[key] = full
        return out

    def memory_report(self) -> dict[str, int]:
        """DDP's report over this rank's stages, plus ``activations``: the peak bytes of activations
        this rank held during the last step (see :mod:`dtlab.models._pipeline_runtime`)."""
        report = super().memory_report()
        report["activations"] = 0 if self._last is None else self._last.peak_activation_bytes
        return report
