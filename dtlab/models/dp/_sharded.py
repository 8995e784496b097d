"""What ZeRO-3 and FSDP share: parameters sharded at rest, gathered on demand, gradients reduce-scattered.

Each :class:`~dtlab.models.dp.flat.FlatUnit` (one per parameter for ZeRO-3, one per wrapped module for
FSDP) keeps only this rank's shard between uses. A *group* of units is gathered (all-gather into a
fresh flat buffer the parameters become views of) by its module's forward pre-hook, the next group
in forward order is prefetched with a non-blocking all-gather, and the group is freed by the forward
hook when ``reshard_after_forward``. For backward, a hook on the module's outputs gathers the group
again before its gradients are computed and prefetches the group before it; saved-tensor hooks
replace every saved tensor that aliases a gathered buffer by a reference, so freeing really releases
the memory and a missing gather is done on demand instead of reading freed storage. When all of a
unit's gradients have been accumulated, they are copied into a padded flat buffer, released, and
reduce-scattered into the unit's gradient shard; the unit is freed. A callback queued on the autograd
engine waits for every reduction before ``loss.backward()`` returns.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models.dp._materialize import MetaInit, ParamInitFn
from dtlab.models.dp._sharded_units import (
    SavedRef,
    ShardUnit,
    UnitPlan,
    partial_load_error,
    partial_state_error,
    read_flat_state,
    write_flat_state,
)
from dtlab.models.dp._sharded_wait import wait_for_every_rank
from dtlab.models.dp.data_parallel import DataParallelModel, tensor_bytes
from dtlab.models.dp.flat import FlatUnit
from dtlab.models.shard_index import ShardIndex, new_state

if TYPE_CHECKING:
    from dtlab.models.compose._placed_state import FlatShard

__all__ = ["ShardedModel", "UnitPlan"]


def _identity(fn: Any) -> Any:
    return fn


class ShardedModel(DataParallelModel):
    """Base of ZeRO3Model and FSDPModel; subclasses provide ``_plan()``."""

    strategy_name: ClassVar[str] = "sharded"

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        reduce_dtype: torch.dtype | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        world: CommunicationBackend | None = None,
        init_seed: int | None = None,
        param_init_fn: ParamInitFn | None = None,
        forward_wait_s: float = 10.0,
    ) -> None:
        if not (isinstance(forward_wait_s, int | float) and forward_wait_s >= 0):
            raise ValueError(
                f"forward_wait_s must be a number of seconds >= 0 (0: no limit), got {forward_wait_s!r}"
            )
        self.forward_wait_s = float(forward_wait_s)
        meta = MetaInit.prepare(module, backend.device, init_seed, param_init_fn, type(self).__name__)
        super().__init__(
            module,
            backend,
            reduce_dtype=reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
            world=world,
        )
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = bool(prefetch)
        p, r = backend.world_size, backend.rank
        self._units: list[ShardUnit] = []
        self._groups: list[list[ShardUnit]] = []
        self._group_modules: list[nn.Module] = []
        self._group_names: list[str] = []
        self._gathered_bytes = 0
        self._peak = 0
        self._last_peak = 0
        for gname, gmodule, plans in self._plan():
            members = [self._new_unit(plan, p, r, fresh=meta is not None) for plan in plans]
            if members:
                self._groups.append(members)
                self._group_modules.append(gmodule)
                self._group_names.append(gname)
        self._peak = self._last_peak = self._gathered_bytes
        if meta is not None:  # built on meta: each rank initializes its own shards, no broadcast
            meta.materialize(self.module, self._units)
        self._busy = False  # inside a forward or backward: freed parameters are empty, not parked
        self._watch = False
        self._broadcast_from_rank0([q.data for _, q in self._frozen])
        self._broadcast_from_rank0(list(self.module.buffers()))
        self._unit_of = {id(q): st for st in self._units for q in st.unit.params}
        self._ptr: dict[int, ShardUnit] = {}
        self._order: list[int] = []
        self._order_done = False
        self._pending: list[tuple[ShardUnit, Work, torch.Tensor]] = []
        self._unit_hooks: list[Any] = []
        self._hooks_for_compile = False
        self._partial_state_ok = False
        self._hook_handles.append(self.module.register_state_dict_pre_hook(self._refuse_partial_state))
        self._hook_handles.append(self.module.register_load_state_dict_pre_hook(self._refuse_partial_load))
        self._install_forward_hooks()
        self._register_grad_hooks(self._on_grad)

    def _plan(self) -> list[tuple[str, nn.Module, list[UnitPlan]]]:
        raise NotImplementedError

    def _new_unit(self, plan: UnitPlan, p: int, r: int, fresh: bool = False) -> ShardUnit:
        """A new unit (appended to the units) with rank 0's values: this rank's shard kept, the whole
        buffer only if persistent. ``fresh`` (built on meta): zeros, filled by :class:`MetaInit`."""
        unit = FlatUnit(plan.key, plan.params, p, r)
        lo, hi = unit.shard_bounds()
        grad = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        if fresh:
            flat = unit.new_flat() if plan.persistent else grad.new_zeros(0)
            shard = torch.zeros_like(grad)
        else:
            flat = unit.new_flat()
            unit.copy_params_into(flat)
            self._broadcast_from_rank0([flat])
            shard = flat[lo:hi].clone()
        st = ShardUnit(unit, shard, grad, plan.persistent, len(self._units))
        if plan.persistent:
            st.flat = flat
            unit.bind(flat)
            self._gathered_bytes += tensor_bytes(flat)
        else:
            unit.park()
        self._units.append(st)
        return st

    # ------------------------------------------------------------------ gather / free
    def _gather(self, st: ShardUnit, wait: bool = True) -> None:
        if st.flat is None:
            flat = st.unit.new_flat(zero=False)
            st.work = self.dp_backend.iall_gather(flat, st.shard)
            st.flat = flat
            st.unit.bind(flat)
            self._ptr[flat.untyped_storage().data_ptr()] = st
            self._gathered_bytes += tensor_bytes(flat)
            self._peak = max(self._peak, self._gathered_bytes)
        if wait and st.work is not None:
            if self._watch:
                self._watch = False
                wait_for_every_rank(st.work, self.forward_wait_s, type(self).__name__, self.dp_backend)
            st.work.wait()
            st.work = None

    def _free(self, st: ShardUnit) -> None:
        if st.persistent or st.flat is None:
            return
        if st.work is not None:
            st.work.wait()
            st.work = None
        self._ptr.pop(st.flat.untyped_storage().data_ptr(), None)
        self._gathered_bytes -= tensor_bytes(st.flat)
        if self._busy:
            st.unit.unbind()
        else:
            st.unit.park()
        st.flat = None

    def _gather_group(self, gi: int, wait: bool = True) -> None:
        for st in self._groups[gi]:
            self._gather(st, wait)

    def _neighbour(self, gi: int, step: int) -> int | None:
        if not self.prefetch or gi not in self._order:
            return None
        pos = self._order.index(gi) + step
        return self._order[pos] if 0 <= pos < len(self._order) else None

    # ------------------------------------------------------------------ hooks
    def _install_forward_hooks(self) -> None:
        """The gather/free hooks; once ``torch.compile`` is loaded, each runs eagerly (a graph break):
        they talk to the backend and swap parameter storage, which a compiled graph cannot do."""
        for handle in self._unit_hooks:
            handle.remove()
        self._hooks_for_compile = "torch._dynamo" in sys.modules
        wrap: Callable[[Any], Any] = torch.compiler.disable if self._hooks_for_compile else _identity
        self._unit_hooks = []
        for gi, gmod in enumerate(self._group_modules):
            self._unit_hooks.append(gmod.register_forward_pre_hook(wrap(self._make_pre_forward(gi))))
            self._unit_hooks.append(gmod.register_forward_hook(wrap(self._make_post_forward(gi))))

    def _make_pre_forward(self, gi: int) -> Any:
        def pre_forward(_module: nn.Module, _args: Any) -> None:
            if not self._order_done and gi not in self._order:
                self._order.append(gi)
            self._gather_group(gi)
            nxt = self._neighbour(gi, +1)
            if nxt is not None and self._order_done:
                self._gather_group(nxt, wait=False)

        return pre_forward

    def _make_post_forward(self, gi: int) -> Any:
        def post_forward(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(gi))
            if self.reshard_after_forward or not torch.is_grad_enabled():  # no backward will free it
                for st in self._groups[gi]:
                    self._free(st)

        return post_forward

    def _make_pre_backward(self, gi: int) -> Any:
        def pre_backward(_grad: torch.Tensor) -> None:
            self._begin_backward()
            self._gather_group(gi)
            prev = self._neighbour(gi, -1)
            if prev is not None and self.reshard_after_forward:
                self._gather_group(prev, wait=False)

        return pre_backward

    def _pack(self, t: torch.Tensor) -> Any:
        st = None if t.numel() == 0 else self._ptr.get(t.untyped_storage().data_ptr())
        if st is None or st.persistent or st.flat is None or t.dtype != st.flat.dtype:
            if self.observe_activation is not None:  # kept as it is: the observer counts it
                self.observe_activation(t)
            return t
        return SavedRef(st.index, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, SavedRef):
            st = self._units[obj.unit]
            self._gather(st)  # normally gathered already by the pre-backward hook
            flat = st.flat
            if flat is None:
                raise RuntimeError(f"unit {st.unit.key} could not be gathered")  # unreachable
            return flat.as_strided(obj.size, obj.stride, obj.offset)
        return cast(torch.Tensor, obj)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._hooks_for_compile and "torch._dynamo" in sys.modules:  # compiled after wrapping
            torch.compiler.disable(self._install_forward_hooks)()
        if torch.is_grad_enabled():
            self._release_guards()
        self._sync_buffers()
        self._watch = not torch.is_grad_enabled() and not self._in_backward and self.forward_wait_s > 0
        self._set_busy(True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = self.module(*args, **kwargs)
        except RuntimeError as exc:
            freed = [st.unit.key for st in self._units if st.flat is None]
            raise StrategyError(
                f"{type(self).__name__}: the wrapped module's forward failed: {exc}\n"
                f"If an operation received an empty (0-element) tensor, it read a sharded parameter "
                f"outside the forward of the module that owns it, so it was not gathered (not gathered "
                f"now: {freed[:5]}). With ZeRO3Model list the owner's parent class in leaf_modules or "
                "raise persistence_threshold; with FSDPModel put both modules in one unit."
            ) from exc
        finally:
            self._watch = False
            self._set_busy(self._in_backward)
        self._order_done = True
        return out

    def _set_busy(self, busy: bool) -> None:
        """Inside a forward or backward, a parameter not gathered is an empty tensor (an operation
        reading it outside its owner's forward fails); between uses it is parked at its logical
        shape (``numel()``, ``dim()``, ``shape`` as the plain module's, no memory held)."""
        if busy == self._busy:
            return
        self._busy = busy
        for st in self._units:
            if st.flat is None:
                if busy:
                    st.unit.unbind()
                else:
                    st.unit.park()

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._set_busy(True)
        super()._begin_backward()

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, param: nn.Parameter) -> None:
        self._begin_backward()
        st = self._unit_of[id(param)]
        st.ready.add(id(param))
        if len(st.ready) < len(st.unit.params):
            return
        if self._sync and not self.find_unused_parameters:
            self._reduce(st)  # with find_unused_parameters every unit is reduced at the end, in unit order
        self._free(st)

    def _reduce(self, st: ShardUnit) -> None:
        unit = st.unit
        gflat = unit.new_flat(zero=False)
        unit.grads_into(gflat)
        for q in unit.params:
            q.grad = None
        out = torch.empty_like(st.grad_shard)
        self._pending.append((st, self._reducer.reduce_scatter(unit.key, gflat, out), out))
        st.reduced = True

    def _end_backward(self) -> None:
        synced = False
        try:
            if self._sync:
                missing = [
                    self._name_of[id(q)]
                    for st in self._units
                    for q in st.unit.params
                    if id(q) not in st.ready
                ]
                if missing and not self.find_unused_parameters:
                    raise self._unused_error(missing)
                for st in self._units:  # deferred (find_unused) or incomplete: fixed unit order
                    if not st.reduced:
                        self._reduce(st)
                for st, work, out in self._pending:
                    work.wait()
                    st.grad_shard.add_(out)
                self._grads_synced = True
                synced = True
        finally:
            self._pending = []
            for st in self._units:
                st.ready.clear()
                st.reduced = False
                self._free(st)
            self._set_busy(False)
        if synced:
            self._guard_grads()

    # ------------------------------------------------------------------ composition
    def reduce_accumulated_grads(self) -> None:
        """Every unit's accumulated gradient reduce-scattered into its shard now."""
        self._reducer.start_step()
        try:
            for st in self._units:
                self._reduce(st)
            for st, work, out in self._pending:
                work.wait()
                st.grad_shard.add_(out)
        finally:
            self._pending = []
            for st in self._units:
                st.reduced = False
        self._grads_synced = True
        self._guard_grads()
        self._after_synchronized()

    @contextlib.contextmanager
    def keep_gathered(self) -> Iterator[None]:
        """Every unit gathered once for the block and kept for all its forwards and backwards (a
        pipeline step: one all-gather per unit instead of two per micro-batch)."""
        held = [st for st in self._units if not st.persistent]
        try:
            for st in held:
                self._gather(st)
                st.persistent = True
            yield
        finally:
            for st in held:
                st.persistent = False
                self._free(st)

    @contextlib.contextmanager
    def gather_hooks_suspended(self) -> Iterator[None]:
        for h in self._unit_hooks:
            h.remove()
        try:
            yield
        finally:
            self._install_forward_hooks()

    def whole_state(self) -> dict[str, torch.Tensor]:
        return self._other_state()

    def flat_shards(self) -> list[FlatShard]:
        return list(self._units)

    # ------------------------------------------------------------------ optimizer protocol
    def shard_units(self) -> list[FlatUnit]:
        return [st.unit for st in self._units]

    def _state(self, unit: FlatUnit) -> ShardUnit:
        for st in self._units:
            if st.unit is unit:
                return st
        raise ValueError(f"unit {unit.key} does not belong to this model")

    def shard_param(self, unit: FlatUnit) -> torch.Tensor:
        return self._state(unit).shard

    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        return self._state(unit).grad_shard

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        for st in self._units:
            if st.flat is not None:  # persistent units (and any still gathered) take the new values
                if st.work is not None:
                    st.work.wait()
                    st.work = None
                self.dp_backend.all_gather(st.flat, st.shard)
        self._last_peak, self._peak = self._peak, self._gathered_bytes

    def zero_grad_buffers(self) -> None:
        self._guarded = False
        for st in self._units:
            st.grad_shard.zero_()
            for q in st.unit.params:
                q.grad = None
        self._grads_synced = False

    def scale_grads_(self, factor: float) -> None:
        for st in self._units:
            st.grad_shard.mul_(factor)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        return [st.grad_shard for st in self._units], False

    # ------------------------------------------------------------------ state
    def _freed_units(self) -> list[str]:
        return [st.unit.key for st in self._units if st.flat is None]

    def _refuse_partial_state(self, *_: Any) -> None:
        """``state_dict()`` of the wrapper or of the wrapped module: the sharded parameters are empty
        tensors between uses, so refuse instead of returning them."""
        freed = self._freed_units()
        if freed and not self._partial_state_ok:
            raise partial_state_error(type(self).__name__, freed, self.backend.world_size)

    def _refuse_partial_load(self, *_: Any, **__: Any) -> None:
        freed = self._freed_units()
        if freed:
            raise partial_load_error(type(self).__name__, freed)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        was = [st.flat is not None for st in self._units]
        for st in self._units:
            self._gather(st)
        out = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for st, keep in zip(self._units, was, strict=True):
            if not keep:
                self._free(st)
        return out

    def _other_state(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters (kept whole on every rank), keyed like ``state_dict()``."""
        sharded = {id(q) for st in self._units for q in st.unit.params}
        self._partial_state_ok = True  # the sharded entries are dropped right here
        try:
            state = self.module.state_dict(keep_vars=True)
        finally:
            self._partial_state_ok = False
        return {k: t for k, t in state.items() if id(t) not in sharded}

    def sharded_state_dict(self) -> ShardedState:
        p, r = self.dp_backend.world_size, self.dp_backend.rank
        state = write_flat_state(new_state(self.strategy_name, p, r), self._units, self._other_state(), p, r)
        aliases = {  # a tied weight's other names (lm_head.weight): the plain state_dict() has them too
            n: self._name_of[id(q)]
            for n, q in self.module.named_parameters(remove_duplicate=False)
            if id(q) in self._unit_of and n != self._name_of[id(q)]
        }
        if aliases:
            state.metadata["aliases"] = aliases
        return state

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        read_flat_state(ShardIndex(shards), self._units, self._other_state(), self.dp_backend)

    def memory_report(self) -> dict[str, int]:
        held = sum(tensor_bytes(st.shard) + tensor_bytes(st.flat) for st in self._units)
        held += sum(tensor_bytes(q) for _, q in self._frozen)
        grads = sum(tensor_bytes(st.grad_shard) for st in self._units)
        grads += sum(tensor_bytes(q.grad) for _, q in self._trainable)
        return {
            "parameters": held,
            "gradients": grads,
            "optimizer_state": self._optimizer_bytes(),
            "buffers": self._buffer_bytes(),
            "peak_gathered_parameters": self._last_peak,
        }
