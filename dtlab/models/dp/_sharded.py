"""What ZeRO-3 and FSDP share: parameters sharded at rest, gathered on demand, gradients reduce-scattered
(docs/strategies.md, "How it works": the gathering, saved-tensor references, the end-of-backward wait)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.core.broadcast import broadcast_from_rank0
from dtlab.core.saved_params import SavedHooks, outer_saved_hooks
from dtlab.core.state import ShardedState
from dtlab.core.traced import eager_when_traced
from dtlab.errors import StrategyError
from dtlab.models.dp._direct import GATHER, STATE, DirectForwards, InnerCalls, same_gathers
from dtlab.models.dp._grad_guard import tensor_bytes
from dtlab.models.dp._materialize import MetaInit, MetaOptions, ParamInitFn
from dtlab.models.dp._owner import check_sharded_options, check_types
from dtlab.models.dp._saved_params import SavedTensors
from dtlab.models.dp._sharded_units import GroupHooks, ShardUnit, UnitGatherer, UnitPlan
from dtlab.models.dp._unused import autograd_grad_message, grads_filled, none_got_one
from dtlab.models.dp._writes import ParamWrites
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.ddp import DataParallelOptions
from dtlab.models.dp.flat import FlatUnit

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from dtlab.models.placed_state import FlatShard

__all__ = ["GatherOptions", "ShardedModel", "ShardedOptions", "UnitPlan"]


class GatherOptions(TypedDict, total=False):
    """How ZeRO-3 and FSDP gather their units (see :class:`~dtlab.models.ZeRO3Model`)."""

    prefetch: bool
    forward_wait_s: float


class ShardedOptions(DataParallelOptions, GatherOptions, MetaOptions, total=False):
    """ZeRO-3's and FSDP's options (see :class:`~dtlab.models.ZeRO3Model`)."""


class ShardedModel(DataParallelModel):
    """Base of ZeRO3Model and FSDPModel; subclasses provide ``_plan()``."""

    strategy_name: ClassVar[str] = "sharded"
    shards_at_rest: ClassVar[bool] = True

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        reshard_after_forward: bool | None = True,
        prefetch: bool = True,
        init_seed: int | None = None,
        param_init_fn: ParamInitFn | None = None,
        forward_wait_s: float = 10.0,
        **options: Unpack[DataParallelOptions],
    ) -> None:
        check_sharded_options(forward_wait_s, reshard_after_forward, prefetch=prefetch)
        self.forward_wait_s = float(forward_wait_s)
        check_types(module, backend, type(self).__name__)
        meta = MetaInit.prepare(module, backend.device, init_seed, param_init_fn, type(self).__name__)
        super().__init__(module, backend, **options)
        self._at_rest = UnitGatherer(backend, self.forward_wait_s, type(self).__name__)
        self._units = self._at_rest.units
        for gmodule, plans in self._plan():
            members = [self._new_unit(plan, fresh=meta is not None) for plan in plans]
            if members:
                self._at_rest.groups.append((gmodule, members))
        self._at_rest.peak = self._last_peak = self._at_rest.gathered_bytes
        if meta is not None:  # built on meta: each rank initializes its own shards, no broadcast
            meta.materialize(self._units)
        broadcast_from_rank0([q.data for _, q in self._frozen] + list(self.module.buffers()), self.dp_backend)
        self._unit_of = {id(q): st for st in self._units for q in st.unit.params}
        self._state_of = {id(st.unit): st for st in self._units}
        self._writes = ParamWrites(self._at_rest, self._unit_of, self.module)
        self._saved = SavedTensors(self._at_rest, self._unit_of)
        self._synced_grads = [st.grad_shard for st in self._units]
        self._pending: list[tuple[ShardUnit, Work, torch.Tensor]] = []
        self._partial_state_ok = False
        self._frozen_pass = False
        self.module.register_state_dict_pre_hook(self._refuse_partial_state)
        self.module.register_load_state_dict_pre_hook(self._refuse_partial_load)
        self._direct = DirectForwards(self._at_rest, self, self.module)  # model.module.generate() in step
        InnerCalls(self._at_rest, self.module, type(self).__name__)  # a unit's inner module called alone
        hooks = (self._begin_backward, reshard_after_forward, bool(prefetch), self._direct.hook)
        self._hooks = GroupHooks(self._at_rest, *hooks)
        self._register_grad_hooks(self._on_grad)

    @property
    def reshard_after_forward(self) -> bool | None:
        return self._hooks.reshard_after_forward

    @property
    def prefetch(self) -> bool:
        return self._hooks.prefetch

    def _plan(self) -> list[tuple[nn.Module, list[UnitPlan]]]:
        raise NotImplementedError

    def _new_unit(self, plan: UnitPlan, fresh: bool) -> ShardUnit:
        """A new unit (appended to the units) with rank 0's values: this rank's shard kept, the whole
        buffer only if persistent. ``fresh`` (built on meta): zeros, filled by :class:`MetaInit`."""
        unit = FlatUnit(plan.key, plan.params, self.backend.world_size, self.backend.rank)
        grad = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        if fresh:
            flat = unit.new_flat() if plan.persistent else grad.new_zeros(0)
            shard = torch.zeros_like(grad)
        else:
            flat = unit.new_flat()
            unit.copy_params_into(flat)
            broadcast_from_rank0([flat], self.dp_backend)
            shard = unit.own_shard(flat).clone()
        st = ShardUnit(unit, shard, grad, plan.persistent)
        self._at_rest.add(st, flat if plan.persistent else None)
        return st

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # under torch.compile the bookkeeping runs eagerly (traced, it compiled a graph per unit shape)
        hooks = eager_when_traced(self._begin_forward)(torch.compiler.is_compiling())
        try:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                out = self.module(*args, **kwargs)
        except Exception as exc:  # not an interrupt: waiting for a collective could then block the exit
            err = self._at_rest.forward_failed(exc, self._backward.open)
            if err is exc:  # the user's exception, an out-of-memory error: as raised
                raise
            raise err from exc
        finally:
            eager_when_traced(self._at_rest.end_forward)(self._backward.open)
        self._hooks.order_done = True
        return out

    def _begin_forward(self, traced: bool) -> SavedHooks:
        """Checks made and units ready for a forward; the saved-tensor hooks to run it under (``traced``:
        the forward is being compiled)."""
        self._writes.check("the forward")
        self._hooks.before_forward()
        self._at_rest.start_forward(not torch.is_grad_enabled() and not self._backward.open)
        self._at_rest.set_busy(True)
        self._saved.outer = outer_saved_hooks()  # what the user's (the pipeline's) hooks would have kept
        return self._saved.hooks(eager=traced or self._hooks.compiled_inside)

    def _begin_backward(self, filling: bool = False) -> None:  # filling: from an accumulated gradient
        if not self._backward.open:
            if self._backward.watching and not filling:  # a pass filling no .grad, already seen
                return
            if (answer := grads_filled(p for _, p in self._trainable)) is None:  # autograd.grad(.., params)
                raise StrategyError(autograd_grad_message(type(self).__name__, self.dp_backend.rank))
            self._at_rest.set_busy(True)
            trainable = any(p.requires_grad for _, p in self._trainable)
            if trainable and not (filling or answer or torch.is_grad_enabled()):  # no .grad, no graph
                self._backward.watch_outer(otherwise=self._free_all)  # nested passes may begin it
                return
            # every parameter frozen now (a GAN's discriminator in the generator's step): as in no_sync()
            self._frozen_pass, self._sync = self._sync and not trainable, self._sync and trainable
        super()._begin_backward()

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, param: nn.Parameter) -> None:
        self._begin_backward(filling=True)
        st = self._unit_of[id(param)]
        st.ready.add(id(param))
        if len(st.ready) < len(st.unit.params):
            return
        if self._sync and not self.find_unused_parameters:
            self._reduce(st)  # with find_unused_parameters every unit is reduced at the end, in unit order
        self._at_rest.free(st)

    def _reduce(self, st: ShardUnit) -> None:
        unit = st.unit
        gflat = unit.new_flat(zero=False)
        unit.grads_into(gflat)
        for q in unit.params:
            q.grad = None
        out = torch.empty_like(st.grad_shard)
        self._pending.append((st, self._reducer.reduce_scatter(unit.key, gflat, out), out))
        st.reduced = True
        self._finish_reductions(keep=1)

    def _finish_reductions(self, keep: int = 0) -> None:
        """Wait for the reductions started first until at most ``keep`` are in flight, adding each result into
        its unit's gradient shard. An engine that overlaps keeps a reduction's input (the unit's whole flat
        gradient) until it is waited for: waiting for the previous one when the next starts (as torch's FSDP2)
        bounds the whole gradients alive in backward to two units, whatever the number of units."""
        while len(self._pending) > keep:
            st, work, out = self._pending.pop(0)
            work.wait()
            st.grad_shard.add_(out)

    def _end_backward(self) -> None:
        try:
            super()._end_backward()
        finally:
            self._free_all()

    def _unused_error(self, missing: list[str]) -> StrategyError:
        err = super()._unused_error(missing)
        return err if len(missing) < len(self._trainable) else none_got_one(err, type(self).__name__)

    def _flush(self, fill_missing: bool) -> None:
        missing = [
            self._name_of[id(q)] for st in self._units for q in st.unit.params if id(q) not in st.ready
        ]
        try:
            if missing and not fill_missing:
                raise self._unused_error(missing)
            if self.find_unused_parameters:  # ranks that ran different modules gathered mixed shards
                same_gathers(self.dp_backend, self._at_rest.take_trace(), type(self).__name__)
            for st in self._units:  # deferred (find_unused), incomplete or accumulated: fixed unit order
                if not st.reduced:
                    self._reduce(st)
            self._finish_reductions()
            self._grads_synced, self._at_rest.solo = True, None  # every rank made this backward
        finally:
            self._pending = []
            for st in self._units:
                st.reduced = False

    def _after_synchronized(self) -> None:
        """After the units are freed (a parameter has its logical shape again): guard ``param.grad``."""
        self._guard_grads()
        super()._after_synchronized()

    def _abandon_backward(self) -> None:
        try:
            for _, work, _ in self._pending:
                work.wait()  # nothing adds into a gradient shard once zero_grad() cleared it
        finally:
            self._pending = []
            self._free_all()

    def _free_all(self) -> None:
        """The end of a backward: every unit not kept gathered freed, the per-step state cleared."""
        for st in self._units:
            st.ready.clear()
            st.reduced = False
            self._at_rest.free(st)
        self._at_rest.set_busy(False)
        self._sync, self._frozen_pass = self._sync or self._frozen_pass, False  # else no_sync() for good

    # ------------------------------------------------------------------ composition
    @contextlib.contextmanager
    def keep_gathered(self, when: str = "gathering the parameters") -> Iterator[None]:
        """Every unit gathered once for the block and kept for all its forwards and backwards (a
        pipeline step: one all-gather per unit instead of two per micro-batch); freed after it unless
        gathered before it."""
        self._direct.settle(GATHER)
        self._writes.check(when)
        self._wrapped_as.check()  # a gather would undo model.module.double() silently
        held = [st for st in self._units if not st.persistent]
        was_freed = [st for st in held if st.flat is None]
        try:
            for st in held:
                self._at_rest.gather(st)
                st.persistent = True
            yield
        finally:
            for st in held:
                st.persistent = False
            for st in was_freed:
                self._at_rest.free(st)

    @contextlib.contextmanager
    def gather_hooks_suspended(self) -> Iterator[None]:
        self._hooks.remove()
        try:
            yield
        finally:
            self._hooks.install()

    # ------------------------------------------------------------------ writes after wrapping
    def apply(self, fn: Callable[[nn.Module], None]) -> Self:
        """``nn.Module.apply``: ``fn(m)`` for every submodule, children first, then the wrapper, with ``m``'s
        own parameters gathered (one module's units at a time); each rank keeps its shard of what ``fn``
        wrote. Collective: every rank calls it (docs/strategies.md, initializing after wrapping)."""
        self._owner.check("model.apply(fn)")
        self._wrapped_as.check()
        self._writes.apply(self.module, fn)
        fn(self)
        return self

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter whole inside the block (the whole model gathered, as FSDP1's); with ``writeback``
        each rank keeps its shard of what the block wrote, else writes are dropped. Every rank enters it."""
        self._owner.check("summon_full_params()")
        persistent = {id(st) for st in self._units if st.persistent}
        with self.keep_gathered():
            yield
            if writeback:
                self._writes.write_back(self._units, persistent)

    def flat_shards(self) -> list[FlatShard]:
        return list(self._units)

    # ------------------------------------------------------------------ optimizer protocol
    def shard_units(self) -> list[FlatUnit]:
        return [st.unit for st in self._units]

    def _state(self, unit: FlatUnit) -> ShardUnit:
        if id(unit) not in self._state_of:
            raise ValueError(f"unit {unit.key} does not belong to this model: pass one of its shard_units()")
        return self._state_of[id(unit)]

    def shard_param(self, unit: FlatUnit) -> torch.Tensor:
        return self._state(unit).shard

    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        return self._state(unit).grad_shard

    def check_grads_ready(self, who: str) -> None:
        super().check_grads_ready(who)
        self._writes.settle(f"{who}.step()")

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        for st in self._units:
            if st.flat is not None:  # persistent units (and any still gathered) take the new values
                self.dp_backend.all_gather(self._at_rest.gather(st), st.shard)  # (a prefetch waited for)
        self._last_peak, self._at_rest.peak = self._at_rest.peak, self._at_rest.gathered_bytes

    def zero_grad_buffers(self, set_to_none: bool = True) -> None:
        super().zero_grad_buffers(set_to_none)  # a backward that raised is cleaned up first
        if not self._backward.open:  # what a forward kept gathered for a backward that never came (its
            self._free_all()  # loss raised, reshard_after_forward=False); a backward re-gathers it

    # ------------------------------------------------------------------ state
    def _refuse_partial_state(self, *_: Any) -> None:
        """``state_dict()`` of the wrapper or of the wrapped module: the sharded parameters are empty
        tensors between uses, so refuse instead of returning them."""
        freed = self._at_rest.freed()
        if freed and not self._partial_state_ok:
            more = " ..." if len(freed) > 3 else ""
            raise StrategyError(
                f"{type(self).__name__}.state_dict(): parameters {freed[:3]}{more} ({len(freed)} units) "
                f"are sharded: this rank holds 1/{self.backend.world_size} of each, so the wrapped module's "
                "state_dict() (which Hugging Face's save_pretrained() calls) would be empty tensors. Call "
                "state = model.full_state_dict() on every rank (collective, as model.state_dict(); whole "
                "tensors keyed like the plain module's), then save on one: hf_model.save_pretrained(path, "
                "state_dict=state, is_main_process=rank == 0); or model.sharded_state_dict() for this rank's "
                "shard (what dtlab.checkpoint saves and loads under any world size)"
            )

    def _refuse_partial_load(self, *_: Any, **__: Any) -> None:
        freed = self._at_rest.freed()
        if freed:
            raise StrategyError(
                f"{type(self).__name__}.load_state_dict(): parameters {freed[:3]} are sharded (empty tensors "
                "on this rank between uses); load a full state dict through the wrapper, "
                "model.load_state_dict(state) on every rank (not model.module.load_state_dict), or "
                "shards with model.load_sharded_state_dict(shards) or dtlab.checkpoint (any world size, "
                "any data-parallel strategy)"
            )

    def full_state_dict(self) -> dict[str, torch.Tensor]:  # a rank saving alone is named (watched gather)
        self._direct.settle(STATE)
        with self._at_rest.watched("model.state_dict()", not self._backward.open):
            return super().full_state_dict()

    def whole_state(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters (kept whole on every rank), keyed like ``state_dict()``."""
        self._partial_state_ok = True  # the sharded entries are dropped right here
        try:
            state = self.module.state_dict(keep_vars=True)
        finally:
            self._partial_state_ok = False
        return {k: t for k, t in state.items() if id(t) not in self._unit_of}

    def sharded_state_dict(self) -> ShardedState:
        self._writes.settle("sharded_state_dict()")
        state = super().sharded_state_dict()
        aliases = {  # a tied weight's other names (lm_head.weight): the plain state_dict() has them too
            n: self._name_of[id(q)]
            for n, q in self.module.named_parameters(remove_duplicate=False)
            if id(q) in self._unit_of and n != self._name_of[id(q)]
        }
        if aliases:
            state.metadata["aliases"] = aliases
        return state

    def _held_bytes(self) -> tuple[int, int, int]:
        held = sum(tensor_bytes(st.shard) + tensor_bytes(st.flat) for st in self._units)
        held += sum(tensor_bytes(q) for _, q in self._frozen)
        grads = sum(tensor_bytes(st.grad_shard) for st in self._units)
        grads += sum(tensor_bytes(q.grad) for _, q in self._trainable)
        return held, grads, self._last_peak
