"""The one model-parallel composition (torchtitan's order): pipeline stages over ``mesh["pp"]``,
tensor-parallel layers inside each stage over ``mesh["tp"]``, then a data-parallel strategy over each
stage's tensor-parallel shards on ``mesh["dp"]``::

    mesh = Mesh(backend, {"pp": 2, "dp": 2, "tp": 2})
    model = HybridShardedModel(TransformerLM(...), mesh, data_parallel="fsdp",
                               tensor_plan=transformer_plan(), schedule="1f1b", micro_batches=4)
    opt = ZeRO3Optimizer(model, torch.optim.AdamW, lr=3e-4)     # zero3 and fsdp; ddp -> DDPOptimizer ...
    loss = model.train_step((x, y), model.cross_entropy)        # x, y: this dp rank's share of the batch
    opt.step(); opt.zero_grad()

Any axis may be 1 (or absent). :class:`~dtlab.models.TensorParallelModel` and
:class:`~dtlab.models.PipelineParallelModel` are this composition with the other axes of size 1 (a ZeRO-1
dp axis, whose gradient sync the optimizer chooses). ``HybridShardedModel(..., data_parallel=...)``
builds an instance of a subclass that composes this class with the chosen strategy's class
(``DDPModel``, ``ZeRO1Model``, ``ZeRO2Model``, ``ZeRO3Model``, ``FSDPModel``), so the optimizer
strategies drive it as they drive that strategy, ``GradientCompressionOptimizer`` swaps its dp reducer,
and every parameter keeps its placement (clipping, finite checks and checkpoints read them). Without a
pipeline, gradients are reduced over dp during backward as the strategy does alone; with one,
``train_step`` runs the schedule with every backward inside ``no_sync()`` and reduces once at the end
(ZeRO-3/FSDP: each unit gathered once per step and kept for all micro-batches). See
docs/strategies.md, "Hybrid parallelism".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import Mesh
from dtlab.core import pairs
from dtlab.core.placement import Placement, Shard, counts_in_norm, placement_of
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models._common import DataParallelModel
from dtlab.models._hybrid_comm import broadcast_over_pp, sum_over_tp
from dtlab.models._hybrid_state import load_placed_state, placements_of, write_placed_state
from dtlab.models._hybrid_sync import grad_pieces, sync_buckets, sync_units
from dtlab.models._hybrid_tree import StageRoot
from dtlab.models._pipeline_comm import StageLinks, infer_through_stages
from dtlab.models._pipeline_runtime import StepResult, check_stage_checkpointing, run_schedule
from dtlab.models._pipeline_schedules import Action, PipelineSchedule, build_schedule, check_schedule_args
from dtlab.models._pipeline_split import Shapes, Stage, TensorSpec, module_blocks, split_blocks, stage_shapes
from dtlab.models._pipeline_split import stage_specs as meta_stage_specs
from dtlab.models._sharded import ShardedModel
from dtlab.models._tensor_comm import broadcast_module_state, gather_over_tp
from dtlab.models._tensor_layers import vocab_parallel_cross_entropy
from dtlab.models._tensor_plan import Plan, apply_plan, resolve_plan
from dtlab.models.ddp import DDPModel
from dtlab.models.fsdp import FSDPModel
from dtlab.models.state import new_state
from dtlab.models.zero1 import ZeRO1Model, gradient_sync_for
from dtlab.models.zero2 import ZeRO2Model
from dtlab.models.zero3 import ZeRO3Model

__all__ = ["DATA_PARALLEL", "HybridShardedModel", "as_mesh"]

#: the data-parallel strategies the dp axis can run
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp")
_AXES = ("pp", "dp", "tp")


def as_mesh(mesh: Mesh | CommunicationBackend, who: str, axis: str | None, axes: Sequence[str]) -> Mesh:
    """The one mesh rule of the model-parallel strategies: a :class:`Mesh` whose axes of size > 1 are
    among ``axes`` (and which has ``axis``, the strategy's own, when given); a plain backend stands for
    a mesh of that one axis."""
    if isinstance(mesh, CommunicationBackend) and axis is not None:
        mesh = Mesh(mesh, {axis: mesh.world_size})
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{who} takes a dtlab.backends.Mesh, got {type(mesh).__name__}; e.g. "
            "Mesh(backend, {'pp': 2, 'dp': -1, 'tp': 2})"
        )
    if axis is not None and axis not in mesh.axis_names:
        raise StrategyError(
            f"{who} needs a mesh with a {axis!r} axis, got axes {list(mesh.axis_names)}; e.g. "
            f"Mesh(backend, {{'dp': -1, {axis!r}: 2}})"
        )
    others = [f"{a}={mesh.size(a)}" for a in mesh.axis_names if a not in axes and mesh.size(a) > 1]
    if others:
        composed = "" if tuple(axes) == _AXES else " (HybridShardedModel composes pp, dp and tp)"
        raise StrategyError(
            f"{who} runs on the mesh axes {', '.join(axes)}; this mesh also has {others}{composed}"
        )
    return mesh


Entries = dict[str, tuple[list[int], torch.dtype, int, Placement]]


def _entries(module: nn.Module, tp: int, owner: dict[int, int]) -> Entries:
    """Every tensor of the whole model: full shape, dtype, the pipeline rank holding it, placement."""
    out: Entries = {}
    for key, t in module.state_dict(keep_vars=True).items():
        placement = placement_of(t)
        shape = list(t.shape)
        if isinstance(placement, Shard):
            shape[placement.dim] *= tp
        out[key] = (shape, t.dtype, owner.get(id(t), 0), placement)
    return out


def _outer_pack() -> Callable[[torch.Tensor], Any] | None:
    """The pack hook of the saved-tensor hooks active around a stage's forward (the pipeline's
    activation meter), so ZeRO-3/FSDP's own hooks can pass activations on to it."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return None if hooks is None else hooks[0]


class HybridShardedModel(DataParallelModel):
    """Pipeline over ``mesh["pp"]``, tensor parallelism over ``mesh["tp"]``, a data-parallel strategy
    over ``mesh["dp"]``.

    Args:
        module: the whole model, built alike on every rank (values come from each stage's rank 0 of
            dp x tp). With a pipeline: an ``nn.Sequential`` or a module with ``pipeline_blocks()``
            (called after the tensor plan has swapped its layers).
        mesh: a :class:`~dtlab.backends.Mesh` with any of the axes ``pp``, ``dp``, ``tp``.
        data_parallel: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"``; its optimizer
            strategy drives the model (``DDPOptimizer``, ``ZeRO1Optimizer``, ``ZeRO2Optimizer``,
            ``ZeRO3Optimizer`` for zero3 and fsdp).
        tensor_plan: ``{"fqn-pattern": style}`` as for ``TensorParallelModel`` (needed when tp > 1).
        schedule, micro_batches, split_points, stages_per_rank: as for ``PipelineParallelModel``; a
            pipeline runs when pp > 1, stages_per_rank > 1 or micro_batches > 1.
        **kwargs: the data-parallel strategy's own options (``bucket_cap_mb``, ``gradient_sync`` for
            zero1 (default: the optimizer's choice), ``wrap_policy`` for fsdp, ``persistence_threshold``
            for zero3, ``reduce_dtype``, ...).
    """

    strategy_name: ClassVar[str] = "hybrid"
    #: the data-parallel strategy of this class (set by the composed subclasses)
    data_parallel: ClassVar[str] = ""
    #: the mesh axis a plain backend stands for (tensor: tp, pipeline: pp), and the axes it runs on
    mesh_axis: ClassVar[str | None] = None
    mesh_axes: ClassVar[tuple[str, ...]] = _AXES
    #: a schedule even at pp = 1 with one micro-batch (PipelineParallelModel)
    always_pipelined: ClassVar[bool] = False

    def __new__(
        cls, module: Any = None, mesh: Any = None, data_parallel: str = "ddp", *args: Any, **kwargs: Any
    ) -> Any:
        if cls is not HybridShardedModel:
            return super().__new__(cls)
        variant = _VARIANTS.get(data_parallel) if isinstance(data_parallel, str) else None
        if variant is None:
            raise StrategyError(
                f"HybridShardedModel(data_parallel={data_parallel!r}): choose one of "
                f"{', '.join(DATA_PARALLEL)}"
            )
        return super().__new__(variant)

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh | CommunicationBackend,
        data_parallel: str = "ddp",
        tensor_plan: Plan | None = None,
        schedule: str = "1f1b",
        micro_batches: int | None = None,
        split_points: Sequence[str] | None = None,
        stages_per_rank: int = 1,
        activation_checkpointing: bool = False,
        **kwargs: Any,
    ) -> None:
        who = type(self).__name__ if self.mesh_axis else "HybridShardedModel"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{who} wraps a torch.nn.Module, got {type(module).__name__}")
        mesh = as_mesh(mesh, who, self.mesh_axis, self.mesh_axes)
        tp, pp = mesh["tp"], mesh["pp"]
        p, v = pp.world_size, stages_per_rank
        m = p if micro_batches is None else micro_batches
        pipelined = self.always_pipelined or p > 1 or v > 1 or m > 1
        if pipelined:  # every check before any work, with the rule and the values
            check_stage_checkpointing(activation_checkpointing, schedule, who)
            check_schedule_args(schedule, p, m, v)
        elif activation_checkpointing:
            raise StrategyError(
                f"{who}(activation_checkpointing=True) checkpoints pipeline stages; without a pipeline "
                "checkpoint blocks instead: dtlab.models.checkpointing.checkpoint_modules(module, "
                "(YourBlock,)) before wrapping"
            )
        elif split_points:
            raise StrategyError(
                f"split_points={list(split_points)} need a pipeline (pp > 1 or stages_per_rank > 1)"
            )
        self.activation_checkpointing = activation_checkpointing
        partial: list[nn.Parameter] = []
        if tensor_plan is not None:  # 1. tensor-parallel layers (every stage's, before the split)
            resolved = resolve_plan(module, tensor_plan, tp.world_size)
            broadcast_module_state(module, tp)  # the data-parallel layer then broadcasts over dp
            partial = apply_plan(module, resolved, tp)
        elif tp.world_size > 1:
            raise StrategyError(
                f"{who} on a mesh with tp={tp.world_size} needs a tensor_plan, e.g. transformer_plan() "
                "for dtlab's TransformerLM"
            )
        self.schedule: PipelineSchedule | None = None
        self._stages: list[Stage] = []
        self._stage_shapes: list[Shapes] = []
        owner: dict[int, int] = {}
        root: nn.Module = module
        if pipelined:  # 2. pipeline stages
            self._stages = split_blocks(module_blocks(module), p * v, split_points)
            self.schedule = build_schedule(schedule, p, m, v)  # dry-run: no deadlock, messages matched
            mine = self.schedule.stages_of(pp.rank)
            for s, stage in enumerate(self._stages):
                self._stage_shapes.append(stage_shapes(stage))
                rank = self.schedule.rank_of(s)
                owner.update({id(t): rank for t in [*stage.parameters(), *stage.buffers()]})
        self._entries = _entries(module, tp.world_size, owner)  # before other stages become meta
        if self.schedule is not None:
            for s, stage in enumerate(self._stages):
                if s not in mine:
                    stage.to("meta")  # other ranks' stages: shapes only (placements are not kept there)
            root = StageRoot(module, {s: self._stages[s] for s in mine})
            if not any(q.requires_grad for q in root.parameters()):
                raise StrategyError(
                    f"pipeline rank {pp.rank} holds stages {list(mine)} with no trainable parameters; move "
                    "the split points so every rank has some"
                )
        self.micro_batches = m
        self._placements = placements_of(root.state_dict(keep_vars=True))
        self._chosen_sync = kwargs.get("gradient_sync") if self.data_parallel == "zero1" else None
        if self.data_parallel == "zero1":
            kwargs["gradient_sync"] = self._chosen_sync or "all_reduce"
        super().__init__(root, mesh["dp"], world=mesh.backend, **kwargs)  # 3. data parallelism
        self.mesh = mesh
        self.tp_group: CommunicationBackend = tp
        self.pp_group: CommunicationBackend = pp
        self._span = mesh["dp", "tp"]
        local = {id(q) for q in root.parameters()}
        self._partial_ids = {id(q) for q in partial if q.requires_grad and id(q) in local}
        self.__dict__["_user_module"] = module  # not registered: other stages are on the meta device
        self._specs: dict[TensorSpec, list[TensorSpec]] = {}
        self._last: StepResult | None = None
        self._outer: Callable[[torch.Tensor], Any] | None = None

    # ------------------------------------------------------------------ structure
    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def stages(self) -> list[Stage]:
        """Every pipeline stage in order (other ranks' hold meta tensors); empty without a pipeline."""
        return list(self._stages)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of vocabulary-split logits (``F.cross_entropy`` over the whole vocabulary)."""
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group)

    # ------------------------------------------------------------------ forward
    def _stage_forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        """One stage through the data-parallel strategy's forward (its buffers, gathers and hooks)."""
        self._outer = _outer_pack()
        try:
            out: torch.Tensor = super().forward(x, stage)
        finally:
            self._outer = None
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Without a pipeline: the data-parallel strategy's forward. With one: inference through every
        stage (no autograd across ranks), the output on every pp rank; training runs ``train_step``."""
        if self.schedule is None:
            return super().forward(*args, **kwargs)
        if self.training and torch.is_grad_enabled():
            raise StrategyError(
                f"{type(self).__name__} with a pipeline trains through train_step((inputs, targets), "
                "loss_fn), which runs the schedule; forward() is inference only: call model.eval() or run it "
                "under torch.no_grad()"
            )
        (x,) = args
        return infer_through_stages(x, self._stage_forward, self._specs_for(x), self.schedule, self.pp_group)

    def _specs_for(self, sample: torch.Tensor) -> list[TensorSpec]:
        """Each stage's output shape for micro-batches like ``sample``: a forward on the meta device
        with the shapes recorded at construction (ZeRO-3/FSDP hold only shards at rest)."""
        key = TensorSpec(tuple(sample.shape), sample.dtype)
        if key not in self._specs:
            hooks = list(getattr(self, "_unit_hooks", []))
            for h in hooks:  # ZeRO-3/FSDP gather hooks must not run for a meta forward
                h.remove()
            try:
                self._specs[key] = meta_stage_specs(self._stages, self._stage_shapes, key)
            finally:
                if hooks:
                    cast(ShardedModel, self)._install_forward_hooks()
        return self._specs[key]

    # ------------------------------------------------------------------ training
    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One step on ``(inputs, targets)`` (this dp rank's share); with a pipeline, its schedule (each
        micro-batch loss / m before backward), then the dp reduction (unless inside ``no_sync()``).
        Returns the batch's mean loss on every rank of the stage's pipeline."""
        if self.schedule is None:
            return super().train_step(batch, loss_fn)
        inputs, targets = batch
        m = self.micro_batches
        who = type(self).__name__
        for what, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise StrategyError(f"{who}.train_step: {what} must be a batched tensor, got {t!r}")
            if t.shape[0] % m:
                raise StrategyError(
                    f"{who}.train_step: the batch of {t.shape[0]} samples ({what}) does not split into "
                    f"micro_batches={m} equal micro-batches; use a batch size that is a multiple of {m}"
                )
        sync = self._sync
        self._check_partial_fresh(sync)
        me = cast(Any, self)
        if getattr(me, "_grad_state", None) == "averaged":  # ZeRO-1: kept gradients, rescaled to add up
            me._scale_own_slices(float(self.dp_backend.world_size))
            me._grad_state = "rescaled"
        micro_in, micro_tg = inputs.chunk(m), targets.chunk(m)
        specs = self._specs_for(micro_in[0])
        pp, plan = self.pp_group, self.schedule
        links = StageLinks(pp, plan, specs) if pp.world_size > 1 else None
        calls = {s: (lambda x, s=s: self._stage_forward(x, s)) for s in plan.stages_of(pp.rank)}
        held = self._hold_gathered() if isinstance(self, ShardedModel) else []
        excluded = {t.untyped_storage().data_ptr() for t in [*self.module.parameters(), inputs, targets]}
        try:
            with self.no_sync():
                result = run_schedule(
                    plan,
                    pp.rank,
                    calls,
                    links,
                    micro_in,
                    micro_tg,
                    loss_fn,
                    excluded,
                    checkpointing=self.activation_checkpointing,
                )
            self._last = result
            if sync:
                self._synchronize()
        finally:
            self._release(held)
        last = plan.rank_of(plan.num_stages - 1)
        loss = None if result.loss is None else result.loss.reshape(1).float()
        return broadcast_over_pp(loss, (1,), torch.float32, last, pp)[0]

    def _hold_gathered(self) -> list[Any]:
        """ZeRO-3/FSDP under a pipeline: every unit of this rank's stages is gathered once per step and
        kept for all its micro-batches (torchtitan runs FSDP under a pipeline so: one all-gather per unit
        and step instead of two per micro-batch; zero-bubble's deferred weight gradients need it too)."""
        me = cast(ShardedModel, self)
        held = [st for st in me._units if not st.persistent]
        for st in held:
            me._gather(st)
            st.persistent = True
        return held

    def _release(self, held: list[Any]) -> None:
        me = cast(ShardedModel, self)
        for st in held:
            st.persistent = False
            me._free(st)

    def _synchronize(self) -> None:
        if isinstance(self, ShardedModel):
            sync_units(self)
        else:
            sync_buckets(cast(DDPModel, self))
        self._sum_partial()

    def _sum_partial(self) -> None:
        """Sequence parallelism: replicated parameters used on a chunk of the sequence have partial
        gradients; sum them over tp (after the dp average: the two sums commute)."""
        if self._partial_ids and self.tp_group.world_size > 1:
            sum_over_tp(grad_pieces(cast(Any, self), lambda q: id(q) in self._partial_ids), self.tp_group)

    def _check_partial_fresh(self, sync: bool) -> None:
        if sync and self._partial_ids and self.tp_group.world_size > 1 and self._grads_synced:
            raise StrategyError(
                f"{type(self).__name__} with sequence parallelism: a synchronized step started while the "
                "gradients of the last one are still there; call opt.zero_grad() between steps and "
                "accumulate micro-batches inside model.no_sync()"
            )

    def _begin_backward(self) -> None:
        if not self._in_backward and self.schedule is None:
            self._check_partial_fresh(self._sync)
        super()._begin_backward()

    def _end_backward(self) -> None:
        sync = self._sync
        super()._end_backward()
        if sync and self.schedule is None:
            self._sum_partial()

    def last_activation_bytes(self) -> int:
        """The peak bytes of activations this rank held during the last pipelined step."""
        return 0 if self._last is None else self._last.peak_activation_bytes

    def last_timeline(self) -> list[tuple[Action, float, float]]:
        """This rank's measured compute intervals of the last pipelined step (``perf_counter`` seconds)."""
        return [] if self._last is None else list(self._last.timeline)

    # ------------------------------------------------------------------ optimizer protocol
    def attach_optimizer(self, optimizer: Any) -> None:
        name = getattr(optimizer, "strategy_name", "")
        fitting = pairs.optimizers_for(self.data_parallel if self.mesh_axis is None else self.strategy_name)
        if name not in fitting:
            drivers = " or ".join(pairs.optimizer_class_name(f) for f in fitting)
            raise StrategyError(
                f"{type(self).__name__}(data_parallel={self.data_parallel!r}) is driven by {drivers}, got "
                f"{type(optimizer).__name__}; "
                "build the optimizer strategy of its data-parallel choice (or choose data_parallel to fit)"
            )
        super().attach_optimizer(optimizer)
        if self.data_parallel == "zero1":
            cast(ZeRO1Model, self).gradient_sync = gradient_sync_for(
                type(self).__name__, self._chosen_sync, optimizer
            )

    def grad_norm_group(self) -> CommunicationBackend:
        """The norm's parts add up over every rank of the mesh."""
        return self.mesh.backend

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """This rank's part of the global norm: each stage's gradients once over dp (dp rank 0 where the
        strategy all-reduces, each rank's own slice where it shards), tp shards on every tp rank and
        replicated tensors on tp rank 0; summed over the whole mesh."""
        super().norm_grad_tensors()  # ZeRO-1: settles a forward without backward
        whole = self.data_parallel == "ddp" or (
            self.data_parallel == "zero1" and cast(ZeRO1Model, self).gradient_sync == "all_reduce"
        )
        tp_rank = self.tp_group.rank
        if whole:
            if self.dp_backend.rank != 0:
                return [], False
            return grad_pieces(
                cast(Any, self), lambda q: counts_in_norm(placement_of(q), {"tp": tp_rank}, ("tp",))
            ), False
        me = cast(Any, self)
        out = []
        for unit in me.shard_units():
            g = me.shard_grad(unit)
            for slot, a, b, off in unit.shard_slots():
                if counts_in_norm(self._placements[slot.name], {"tp": tp_rank}, ("tp",)):
                    out.append(g[off : off + b - a])
        return out, False

    def placed(self, name: str) -> tuple[Placement, int, int]:
        """Parameter ``name``'s placement, this rank's coordinate and the size of its axis."""
        placement = self._placements[name]
        if isinstance(placement, Shard):
            return placement, self.mesh.coordinate(placement.axis), self.mesh.size(placement.axis)
        return placement, 0, 1

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the whole model, keyed like the module's ``state_dict()``, on every rank
        (collective: gathers over dp under ZeRO-3/FSDP, over tp for its shards, over pp for stages)."""
        local = super().full_state_dict()  # type: ignore[safe-super]  # the composed strategy's
        tp, pp = self.tp_group, self.pp_group
        out = {}
        for key, (shape, dtype, owner, placement) in self._entries.items():
            mine: torch.Tensor | None = None
            if owner == pp.rank:
                mine = local[key]
                if isinstance(placement, Shard):
                    mine = gather_over_tp(mine, placement, tp)
            out[key] = broadcast_over_pp(mine, shape, dtype, owner, pp)
        return out

    def _held(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        if isinstance(self, ShardedModel):
            return self._other_state(), list(self._units)
        return dict(self.module.state_dict(keep_vars=True)), []

    def sharded_state_dict(self) -> ShardedState:
        """This rank's placed shards: tp shards split over dp, replicated tensors split over dp x tp."""
        world = self.mesh.backend
        state = new_state(self.strategy_name, world.world_size, world.rank, mesh=dict(self.mesh.shape))
        state.metadata["data_parallel"] = self.data_parallel
        whole, units = self._held()
        return write_placed_state(
            state, whole, units, self._placements, self.dp_backend, self.tp_group, self._span
        )

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load from any saved mesh and strategy (or a plain module's full tensors)."""
        whole, units = self._held()
        load_placed_state(shards, whole, units, self._placements, self.tp_group, self.dp_backend)

    def memory_report(self) -> dict[str, int]:
        """The data-parallel strategy's report over this rank's stages and tp shards; with a pipeline,
        ``activations``: the peak bytes of activations held during the last step."""
        report = super().memory_report()  # type: ignore[safe-super]  # the composed strategy's
        if self.schedule is not None:
            report["activations"] = self.last_activation_bytes()
        return report


def _chained_pack(model: HybridShardedModel, packed: Any, t: torch.Tensor) -> Any:
    outer = model._outer
    if outer is not None and packed is t:  # an activation, not a gathered parameter: the meter counts it
        outer(t)
    return packed


class _HybridDDP(HybridShardedModel, DDPModel):
    data_parallel = "ddp"


class _HybridZeRO1(HybridShardedModel, ZeRO1Model):
    data_parallel = "zero1"


class _HybridZeRO2(HybridShardedModel, ZeRO2Model):
    data_parallel = "zero2"


class _HybridZeRO3(HybridShardedModel, ZeRO3Model):
    data_parallel = "zero3"

    def _pack(self, t: torch.Tensor) -> Any:
        return _chained_pack(self, ZeRO3Model._pack(self, t), t)


class _HybridFSDP(HybridShardedModel, FSDPModel):
    data_parallel = "fsdp"

    def _pack(self, t: torch.Tensor) -> Any:
        return _chained_pack(self, FSDPModel._pack(self, t), t)


_VARIANTS: dict[str, type[HybridShardedModel]] = {
    "ddp": _HybridDDP,
    "zero1": _HybridZeRO1,
    "zero2": _HybridZeRO2,
    "zero3": _HybridZeRO3,
    "fsdp": _HybridFSDP,
}

#: the composition with a ZeRO-1 dp axis whose gradient sync the optimizer chooses (tensor, pipeline)
ZeRO1Composition = _HybridZeRO1
