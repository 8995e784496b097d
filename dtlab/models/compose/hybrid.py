"""The one model-parallel composition (torchtitan's order): pipeline stages over ``mesh["pp"]``,
tensor-parallel layers inside each stage over ``mesh["tp"]``, then a data-parallel strategy over each
stage's tensor-parallel shards on ``mesh["dp"]`` (a worked example: docs/strategies.md, "Hybrid
parallelism"; where each decision is made: docs/architecture.md).

The data-parallel strategy (``model.dp_strategy``) is used, not inherited: this model offers the optimizer's
interface by forwarding to it. Without a pipeline, gradients are reduced during backward as the strategy
does alone; with one, ``train_step`` runs the schedule inside ``no_sync()`` and reduces once at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.core import pairs
from dtlab.core.placement import Placement, Shard, counts_in_norm, placement_of
from dtlab.core.plan import RunPlan, TpBatchCheck, TpBatchCheckWhen
from dtlab.core.reducer import GradientReducer
from dtlab.core.shard_index import new_state
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models.base import AttachedOptimizer, OptimizerTarget
from dtlab.models.compose._build import AXES, PipelineArgs, as_mesh, data_parallel_choice, lay_out
from dtlab.models.compose._habits import (
    PartialState,
    check_call,
    gather_whole_state,
    missing_attribute,
    whole_over_tp,
)
from dtlab.models.compose._meta_walk import MetaWalk
from dtlab.models.compose._pipelined import ONE_TENSOR, PipelineRun
from dtlab.models.compose._plan import check_plan, plan_arguments, plan_mesh
from dtlab.models.compose._tied import TiedSync
from dtlab.models.compose._tp_grads import PartialGrads, SameReplicatedGrads, TensorParallelGrads, grads_of
from dtlab.models.dp._materialize import MetaOptions, ParamInitFn, on_meta
from dtlab.models.dp._sharded import GatherOptions
from dtlab.models.dp._sync_bn import refuse_sync_batch_norm
from dtlab.models.dp._torch_methods import ForwardedSync
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.ddp import BucketOptions
from dtlab.models.dp.flat import FlatUnit
from dtlab.models.dp.fsdp import WrapPolicy
from dtlab.models.dp.zero1 import GradientSync, ZeRO1Model, gradient_sync_for
from dtlab.models.pipeline._schedules import Action
from dtlab.models.placed_state import load_placed_state, write_placed_state
from dtlab.models.step_args import batch_pair
from dtlab.models.tensor import vocab_parallel_cross_entropy, whole_cross_entropy
from dtlab.models.tensor._agree import SameOnTp
from dtlab.models.tensor._attentions import head_count_hint, whole_attentions
from dtlab.models.tensor._plan import Plan, logits_head
from dtlab.models.tensor._split_logits import SplitLogits, as_split_logits, unmarked

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["HybridOptions", "HybridShardedModel", "PlanOptions"]


class HybridOptions(BucketOptions, GatherOptions, total=False):
    """``HybridShardedModel``'s ``**kwargs``: the options of its ``data_parallel`` choice."""

    gradient_sync: GradientSync | None  #: zero1 (None: the optimizer's choice)
    persistence_threshold: int  #: zero3
    leaf_modules: tuple[type[nn.Module], ...]  #: zero3
    wrap_policy: WrapPolicy | None  #: fsdp
    reshard_after_forward: bool | None  #: fsdp (None: every unit but the root resharded, as FSDP2)


class PlanOptions(HybridOptions, MetaOptions, total=False):
    """``from_plan``'s ``**kwargs``: the strategy's options, ``init_seed`` and ``param_init_fn``."""


class HybridShardedModel(ForwardedSync, OptimizerTarget):
    """Pipeline over ``mesh["pp"]``, tensor parallelism over ``"tp"``, a data-parallel strategy over ``"dp"``.

    Args:
        module: the whole model, built alike on every rank (values come from each stage's rank 0 of
            dp x tp). With a pipeline: an ``nn.Sequential`` or a module with ``pipeline_blocks()``
            (called after the tensor plan has swapped its layers).
        mesh: a :class:`~dtlab.backends.Mesh` with any of the axes ``pp``, ``dp``, ``tp``.
        data_parallel: ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"``; its optimizer
            strategy drives the model (``DDPOptimizer``, ``ZeRO1Optimizer``, ``ZeRO2Optimizer``,
            ``ZeRO3Optimizer`` for zero3 and fsdp).
        tensor_plan: ``"auto"`` (the plan the module declares) or ``{"fqn-pattern": style}``, as for
            ``TensorParallelModel`` (needed when tp > 1).
        schedule, micro_batches, split_points, stages_per_rank: as for ``PipelineParallelModel``; a
            pipeline runs when pp > 1, stages_per_rank > 1 or micro_batches > 1.
        init_seed: for a module built on the meta device (``with torch.device("meta"):``): each rank
            initializes only its part (its stages, their tp slices, under zero3/fsdp their dp shards),
            bitwise the model built plainly under ``seeded_init(init_seed)`` and wrapped (see
            :mod:`dtlab.models.compose._meta_walk`).
        param_init_fn: ``fn(module)`` filling a module's own parameters and meta buffers in place,
            instead of its ``reset_parameters()`` (a Hugging Face model's ``_init_weights`` by default).
        tp_batch_check: how often the tp ranks' batches are compared (one small all-reduce each):
            ``"always"`` (default), ``"first"`` (the first step), ``"never"``, or a
            :class:`~dtlab.core.plan.TpBatchCheck` (``TpBatchCheck("first", first=N)``).
        **kwargs: the data-parallel strategy's own options (``bucket_cap_mb``, ``gradient_sync`` for
            zero1 (default: the optimizer's choice), ``wrap_policy`` for fsdp, ``persistence_threshold``
            for zero3, ``reduce_dtype``, ...).
    """

    strategy_name: ClassVar[str] = "hybrid"
    #: the mesh axis a plain backend stands for (tensor: tp, pipeline: pp), and the axes it runs on
    mesh_axis: ClassVar[str | None] = None
    mesh_axes: ClassVar[tuple[str, ...]] = AXES
    #: a schedule even at pp = 1 with one micro-batch (PipelineParallelModel)
    always_pipelined: ClassVar[bool] = False

    def __init__(
        self,
        module: nn.Module,
        mesh: MeshLike | CommunicationBackend,
        data_parallel: str = "ddp",
        tensor_plan: Plan | None = None,
        schedule: str = "1f1b",
        micro_batches: int | None = None,
        split_points: Sequence[str] | None = None,
        stages_per_rank: int = 1,
        activation_checkpointing: bool = False,
        *,
        init_seed: int | None = None,
        param_init_fn: ParamInitFn | None = None,
        tp_batch_check: TpBatchCheck | TpBatchCheckWhen = "always",
        **kwargs: Unpack[HybridOptions],
    ) -> None:
        who = type(self).__name__
        dp_class, options, chosen_sync = data_parallel_choice(who, data_parallel, kwargs)
        batch_check = TpBatchCheck.of(tp_batch_check, who)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{who} wraps a torch.nn.Module, got {type(module).__name__}")
        mesh = as_mesh(mesh, who, self.mesh_axis, self.mesh_axes)
        args = PipelineArgs(schedule, micro_batches, split_points, stages_per_rank, activation_checkpointing)
        seed = on_meta(module, init_seed, param_init_fn, who, "its part")  # None: not built on meta
        walk = None if seed is None else MetaWalk(who, module, seed, param_init_fn)
        layout = lay_out(who, module, mesh, tensor_plan, args, self.always_pipelined, walk is not None)
        if layout.schedule is not None or mesh.size("tp") > 1:  # SyncBatchNorm syncs over dp alone
            refuse_sync_batch_norm(module, who, "tp" if layout.schedule is None else "a pipeline")
        root = layout.root
        if walk is not None:  # each rank materializes only its stages' tp shards (and dp shards)
            walk.bind(root, layout.swapped, mesh["tp"])
            if data_parallel in ("zero3", "fsdp"):
                options.update(init_seed=walk.seed, param_init_fn=walk.fill)
            else:
                walk.run(root, mesh.backend.device)
        #: whether the output (the logits) is split over tp: cross_entropy is then vocabulary-parallel
        head = logits_head(module)  # the whole model: the same on every pipeline rank; at tp = 1 whole
        self.logits_split = head is not None and head.group.world_size > 1
        if head is not None and self.logits_split:  # its output refuses a loss over part of it
            head.mark_output = as_split_logits
        # placements read before ZeRO-3/FSDP shard the tensors
        placements = {k: placement_of(t) for k, t in root.state_dict(keep_vars=True).items()}
        dp = dp_class(root, mesh["dp"], world=mesh.backend, **options)  # 3. data parallelism
        super().__init__(root, mesh["dp"], world=mesh.backend)
        self.__dict__["_dp"] = dp  # used, not registered: its module is this model's module
        self._check_as_outer(dp)  # model.module converted: refused once per forward, named as this class
        self.data_parallel = data_parallel
        self.activation_checkpointing = activation_checkpointing
        self.schedule = layout.schedule
        self.micro_batches = layout.micro_batches
        self.mesh = mesh
        self.tp_group: CommunicationBackend = mesh["tp"]
        self.pp_group: CommunicationBackend = mesh["pp"]
        self._same_on_tp = SameOnTp(who, self.tp_group, mesh.ranks("tp"), batch_check, root)  # same batches
        self._layout, self._placements = layout, placements
        self._chosen_sync = chosen_sync
        self._span = mesh["dp", "tp"]
        #: sequence parallelism's parameters with partial gradients over tp
        tp_split = self.tp_group.world_size > 1
        self._partial = PartialGrads(dp, layout.partial if tp_split else set(), mesh["tp"])
        left_whole = (n for n, _ in dp.trainable_parameters() if not isinstance(placements[n], Shard))
        #: the parameters whose gradient every tp rank computes whole and alike (none at tp = 1)
        self.same_grad_over_tp = frozenset(left_whole if tp_split else ()) - self._partial.names
        self._tied = TiedSync(layout.ties, root, dp)  # weights tied across pipeline ranks
        # parameters left whole get the same gradient on every tp rank: compared after the first backward
        SameReplicatedGrads(dp, self.same_grad_over_tp, mesh["tp"], mesh["pp"], who, batch_check.when)
        whole = dp.keeps_whole_grads  # param.grad: views to guard
        split = {n for n, pl in placements.items() if isinstance(pl, Shard) and whole and tp_split}
        staged = self.pp_group.world_size > 1 and whole
        self._tp_grads = TensorParallelGrads(dp, split, who, staged)
        self._pipe = None
        if layout.schedule is not None:
            self._pipe = PipelineRun(
                dp, layout, layout.schedule, mesh, module, self._tied, activation_checkpointing
            )
            self._same_on_tp.over_pipeline = self._pipe.same_on_pp  # checked over pp x tp
            self._pipe.mark_output = as_split_logits if self.logits_split else unmarked  # every pp rank alike
        self._own_state = PartialState(module, who, placements, mesh, pipelined=layout.schedule is not None)

    @staticmethod
    def from_plan(
        module: nn.Module, mesh: MeshLike | CommunicationBackend, plan: RunPlan, **kwargs: Unpack[PlanOptions]
    ) -> HybridShardedModel:
        """The composition ``plan`` describes, on ``mesh`` (with the plan's sizes) or on a mesh built over
        a plain backend; ``kwargs``: the data-parallel strategy's options. Always this class."""
        mesh, plan = plan_mesh(mesh, plan)
        return HybridShardedModel(module, mesh, **plan_arguments(plan), **kwargs)

    check_plan = staticmethod(check_plan)

    # ------------------------------------------------------------------ structure
    @property
    def dp_strategy(self) -> DataParallelModel:
        """The data-parallel strategy over this rank's stages and tp shards (on ``mesh["dp"]``)."""
        return cast("DataParallelModel", self.__dict__["_dp"])

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def find_unused_parameters(self) -> bool:  # the strategy's (compression's skipped-residual check)
        return self.dp_strategy.find_unused_parameters

    def apply(self, fn: Callable[[nn.Module], None]) -> Self:  # through dp (ZeRO-3/FSDP gather), tp whole
        self.dp_strategy.apply(whole_over_tp(fn, self.tp_group, skip=self.dp_strategy))
        fn(self)
        return self

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the whole vocabulary: vocabulary-parallel when the model's output is
        split over tp (``logits_split``), else ``F.cross_entropy`` of the whole logits; labels -100 are
        left out of the mean, and where every label is -100 it is 0 with zero gradients."""
        self._same_on_tp("targets", [("targets", targets)])
        if self.logits_split:
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group)
        return whole_cross_entropy(logits, targets)

    @property
    def gradient_reducer(self) -> GradientReducer:
        return self.dp_strategy.gradient_reducer

    @gradient_reducer.setter
    def gradient_reducer(self, reducer: GradientReducer) -> None:
        self.dp_strategy.gradient_reducer = reducer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:  # backward passes (or pipelined steps) accumulate locally
        with self.dp_strategy.no_sync():
            yield

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as exc:  # what the plain model has: how to reach it (or why not)
            raise missing_attribute(type(self).__name__, self.__dict__.get("_own_state"), name, exc) from None

    # ------------------------------------------------------------------ forward and step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Without a pipeline: the data-parallel strategy's forward. With one: inference through every
        stage (no autograd across ranks), the output on every pp rank; training runs ``train_step``."""
        self._tp_grads.release()
        training = self.training and torch.is_grad_enabled()
        check_call(type(self).__name__, args, kwargs, self._pipe is not None, self.logits_split, training)
        tp_hint = head_count_hint(type(self).__name__, self.mesh.size("tp"))
        with self._same_on_tp.inputs(args, kwargs), self._wrapped_as, tp_hint:
            if self._pipe is None:  # dtype/device checked here only (before a schedule: a refusal would hang)
                if torch.is_grad_enabled():
                    self._partial.before_accumulate(type(self).__name__)
                out = self.dp_strategy(*args, **kwargs)  # attention weights of this rank's heads gathered
                return whole_attentions(out, self.module, self.tp_group, type(self).__name__)
            return self._pipe.infer(args[0])  # check_call: one positional argument

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One step on ``(inputs, targets)`` (this dp rank's share); with a pipeline, its schedule (each
        micro-batch loss / m before backward), then the dp reduction (unless inside ``no_sync()``).
        Returns the batch's mean loss on every rank of the stage's pipeline."""
        self._tp_grads.release()
        if self.logits_split and loss_fn in SplitLogits.refused:  # on every rank, before any stage runs
            raise StrategyError(
                f"{type(self).__name__}.train_step: loss_fn {getattr(loss_fn, '__name__', loss_fn)} on the "
                "logits split over tp would see this rank's part of the classes only; use model.cross_entropy"
            )
        hint = f"; {ONE_TENSOR}" if self._pipe is not None else ""
        inputs, targets = batch_pair(type(self).__name__, batch, loss_fn, hint)  # or refused
        with self._same_on_tp.step((inputs, targets)):  # under a pipeline over pp x tp (same_on_pp)
            if self._pipe is None:
                return super().train_step((inputs, targets), loss_fn)
            with self._wrapped_as:  # checked on every rank before the schedule: a refusal in it would hang
                self._pipe.check_batch(type(self).__name__, inputs, targets)
                self._partial.before_accumulate(type(self).__name__)
                return self._pipe.step(type(self).__name__, inputs, targets, loss_fn)

    def last_timeline(self) -> list[tuple[Action, float, float]]:
        """This rank's measured compute intervals of the last pipelined step (``perf_counter`` seconds)."""
        last = None if self._pipe is None else self._pipe.last
        return [] if last is None else list(last.timeline)

    # ------------------------------------------------------------------ optimizer protocol
    def attach_optimizer(self, optimizer: AttachedOptimizer) -> None:
        fitting = pairs.optimizers_for(self.data_parallel if self.mesh_axis is None else self.strategy_name)
        if optimizer.strategy_name not in fitting:
            drivers = " or ".join(pairs.optimizer_class_name(f) for f in fitting)
            raise StrategyError(
                f"{type(self).__name__}(data_parallel={self.data_parallel!r}) is driven by {drivers}, got "
                f"{type(optimizer).__name__}; build the optimizer strategy of its data-parallel choice (or "
                "choose data_parallel to fit)"
            )
        dp = self.dp_strategy
        dp.attach_optimizer(optimizer)
        if isinstance(dp, ZeRO1Model):
            dp.gradient_sync = gradient_sync_for(type(self).__name__, self._chosen_sync, optimizer)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.dp_strategy.trainable_parameters()

    def check_grads_ready(self, who: str) -> None:
        self._own_state.check_unchanged(who, self.dp_strategy.check_grads_ready)  # prune since wrapping

    def shard_units(self) -> list[FlatUnit]:
        return self.dp_strategy.shard_units()

    def shard_param(self, unit: FlatUnit) -> torch.Tensor:
        return self.dp_strategy.shard_param(unit)

    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        return self.dp_strategy.shard_grad(unit)

    def after_optimizer_step(self) -> None:
        self.dp_strategy.after_optimizer_step()

    def gather_updated_shards(self) -> None:
        self.dp_strategy.gather_updated_shards()

    def unused_params(self) -> frozenset[int]:
        return self.dp_strategy.unused_params()

    def zero_grad_buffers(self, set_to_none: bool = True) -> None:
        self.dp_strategy.zero_grad_buffers(set_to_none)
        self._partial.cleared()
        if self._pipe is not None:
            self._pipe.zero_grad()

    def scale_grads_(self, factor: float) -> None:
        self.dp_strategy.scale_grads_(factor)

    def grad_norm_group(self) -> CommunicationBackend:  # the norm's parts add up over the whole mesh
        return self.mesh.backend

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """This rank's part of the global norm: each stage's gradients once over dp (dp rank 0 where the
        strategy all-reduces, each rank's own slice where it shards), tp shards on every tp rank and
        replicated tensors on tp rank 0; summed over the whole mesh."""
        dp, tp = self.dp_strategy, {"tp": self.tp_group.rank}
        _, replicated = dp.norm_grad_tensors()  # also settles ZeRO-1 after a forward without backward
        if replicated and self.dp_backend.rank != 0:
            return [], False
        skip = self._tied.norm_skip

        def counted(n: str) -> bool:
            return n not in skip and counts_in_norm(self._placements[n], tp, ("tp",))

        return grads_of(dp, counted, replicated), False

    def placed(self, name: str) -> tuple[Placement, int, int]:
        placement = self._placements[name]
        if isinstance(placement, Shard):
            return placement, self.mesh.coordinate(placement.axis), self.mesh.size(placement.axis)
        return placement, 0, 1

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the whole model, keyed like the module's ``state_dict()``, on every rank
        (collective: gathers over dp under ZeRO-3/FSDP, over tp for its shards, over pp for stages)."""
        local = self._own_state.read(self.dp_strategy.full_state_dict)
        return gather_whole_state(local, self._layout.entries, self.tp_group, self.pp_group)

    def sharded_state_dict(self) -> ShardedState:
        """This rank's placed shards: tp shards split over dp, replicated tensors split over dp x tp."""
        world, dp = self.mesh.backend, self.dp_strategy
        state = new_state(self.strategy_name, world.world_size, world.rank, mesh=dict(self.mesh.shape))
        state.metadata["data_parallel"] = self.data_parallel
        if self._layout.aliases:
            state.metadata["tied"] = dict(self._layout.aliases)  # stored once, under the first name
        whole = dp.whole_state()
        where = (self._placements, self.dp_backend, self.tp_group, self._span)
        return write_placed_state(state, whole, dp.flat_shards(), *where, skip=self._layout.unwritten)

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load from any saved mesh and strategy (or a plain module's full tensors)."""
        dp, where = self.dp_strategy, (self._placements, self.dp_backend, self.tp_group, self._layout.aliases)
        load_placed_state(shards, dp.whole_state(), dp.flat_shards(), *where)

    def tied_names(self) -> dict[str, str]:
        return dict(self._layout.aliases)

    def memory_report(self) -> dict[str, int]:
        """The data-parallel strategy's report over this rank's stages and tp shards; with a pipeline,
        ``activations``: the peak bytes of activations held during the last step."""
        report = self.dp_strategy.memory_report()
        if self._pipe is not None:
            report["activations"] = 0 if self._pipe.last is None else self._pipe.last.peak_activation_bytes
        return report
