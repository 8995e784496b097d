"""ZeRO-3/FSDP's units between uses (:class:`UnitGatherer`) and their gather hooks (:class:`GroupHooks`).

A unit is gathered by an all-gather into a fresh flat buffer its parameters become views of, and freed
by dropping that buffer (saved tensors aliasing it are kept as references: ``_saved_params.py``). The
first gather of an evaluation (no-grad) forward is polled for ``forward_wait_s`` where the engine's
handle can be polled (:attr:`dtlab.backends.types.Work.polls`: Gloo and NCCL; the in-memory world names
a mismatched call at once; MPI waits): a rank that evaluates alone (a DDP habit) is named within seconds
instead of waiting for the collective timeout. When the others go on training instead, their gathers
pair with the evaluation's and the ranks fall out of step later: a mismatch of collectives met before
the next synchronized backward names the call.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.core.torch_private import MODULE_HOOKS, compiled_inside
from dtlab.errors import CollectiveMismatchError, StrategyError, every_rank_saves
from dtlab.models.base import copy_refused
from dtlab.models.dp._grad_guard import tensor_bytes
from dtlab.models.dp.flat import FlatUnit

__all__ = ["GroupHooks", "ShardUnit", "UnitGatherer", "UnitPlan"]


@dataclass(frozen=True)
class UnitPlan:
    """One flat unit to build: its key, its parameters and whether it stays gathered."""

    key: str
    params: list[tuple[str, nn.Parameter]]
    persistent: bool = False


@dataclass
class ShardUnit:
    """A flat unit at rest as this rank's shard, with its gathered buffer while in use."""

    unit: FlatUnit
    shard: torch.Tensor
    grad_shard: torch.Tensor
    persistent: bool
    flat: torch.Tensor | None = None
    work: Work | None = None
    ready: set[int] = field(default_factory=set)
    reduced: bool = False


class UnitGatherer:
    """The units of one sharded strategy, grouped by the module whose forward gathers them."""

    def __init__(self, group: CommunicationBackend, forward_wait_s: float, who: str) -> None:
        self.group = group
        self.forward_wait_s = forward_wait_s
        self.who = who
        self.units: list[ShardUnit] = []
        #: each module whose forward gathers units, with those units
        self.groups: list[tuple[nn.Module, list[ShardUnit]]] = []
        self.gathered_bytes = 0
        self.peak = 0
        #: inside a forward or backward: freed parameters are empty tensors, not parked
        self.busy = False
        #: the next gather is an evaluation forward's first: named if a rank does not join in time
        self.watch = False
        #: the unit whose watched gather the other ranks did not join in time (its gather left pending)
        self.unjoined: ShardUnit | None = None
        #: the call whose first gather is watched ("forward", or the state dict's)
        self.watching = "forward"
        #: a call this rank may have made alone (an evaluation "forward", the state dict) since the last
        #: synchronized backward: a gather that meets another collective names it (:meth:`gather`)
        self.solo: str | None = None
        #: each gathered buffer's unit, by storage pointer (a saved tensor aliasing one: a reference)
        self.by_storage: dict[int, ShardUnit] = {}
        #: which units were gathered, in order, since :meth:`take_trace` (ranks running other modules differ)
        self.trace = 0
        self._index: dict[int, int] = {}

    def add(self, st: ShardUnit, flat: torch.Tensor | None) -> None:
        """A new unit: kept gathered in ``flat`` when persistent, parked otherwise."""
        if flat is not None:
            st.flat = flat
            st.unit.bind(flat)
            self.gathered_bytes += tensor_bytes(flat)
        else:
            st.unit.park()
        self._index[id(st)] = len(self.units)
        self.units.append(st)

    def gather(self, st: ShardUnit, wait: bool = True) -> torch.Tensor:
        """``st``'s gathered buffer (all-gathered now unless it is already)."""
        flat = st.flat
        if flat is not None and (st.work is None or not wait):  # at each unpack of a saved parameter
            return flat
        try:  # no context manager: about 1 us a gather
            return self._gather(st, wait)
        except CollectiveMismatchError as exc:  # after a call this rank may have made alone (``solo``):
            if self.solo is None:  # the other ranks went on training, their gathers paired with this one's
                raise
            met = (
                "(made on this rank since the last synchronized backward) gathered the parameters, and the "
                f"other ranks called other collectives ({exc})"
            )
            raise StrategyError(self._unjoined_message(self.solo, met)) from exc

    def _gather(self, st: ShardUnit, wait: bool) -> torch.Tensor:
        flat = st.flat
        if flat is None:
            flat = st.unit.new_flat(zero=False)
            st.work = self.group.iall_gather(flat, st.shard)
            self.trace = (self.trace * 131 + self._index[id(st)] + 1) % 2_147_483_647
            st.flat = flat
            st.unit.bind(flat)
            self.by_storage[flat.untyped_storage().data_ptr()] = st
            self.gathered_bytes += tensor_bytes(flat)
            self.peak = max(self.peak, self.gathered_bytes)
        if wait and st.work is not None:
            if self.watch:
                self.watch = False
                self.unjoined = st
                self._wait_for_every_rank(st.work)
                self.unjoined = None
            st.work.wait()
            st.work = None
        return flat

    def take_trace(self) -> int:
        """The fingerprint of the gathers since the last call (a float64 holds it exactly)."""
        trace, self.trace = self.trace, 0
        return trace

    def _wait_for_every_rank(self, work: Work) -> None:
        """Return once ``work`` completed; after ``forward_wait_s`` raise an error naming the cause (the
        caller then stops: the gather is left pending)."""
        deadline = time.monotonic() + self.forward_wait_s
        while work.polls and not work.is_completed():
            if time.monotonic() > deadline:
                waited = (
                    f"waited {self.forward_wait_s:g} s for the other {self.group.world_size - 1} rank(s) of "
                    "its data-parallel group to gather the parameters"
                )
                late = " If a rank is legitimately that late, pass a larger forward_wait_s"
                raise StrategyError(self._unjoined_message(self.watching, waited, late))
            time.sleep(0.0005)

    def _unjoined_message(self, call: str, waited: str, late: str = "") -> str:
        who = f"{self.who} on rank {self.group.rank}"
        if call != "forward":
            fix = every_rank_saves(call, "1/P of the parameters")
            return f"{who}: {call} {waited}: {fix}.{late}"
        return (
            f"{who}: the evaluation (no-grad) forward {waited}. Under a sharded strategy every rank must "
            "call forward (each holds 1/P of the parameters), evaluation too: evaluate on every rank (each "
            "on its part of the data, then average the metric), or call model.state_dict() on every rank "
            f"and evaluate a plain copy on one rank.{late}"
        )

    def start_forward(self, evaluating: bool) -> None:
        """A forward begins (``evaluating``: without gradients, outside a backward) or ends (False); not
        :meth:`watched`, a context manager: this runs at every forward."""
        self.watch = evaluating and self.forward_wait_s > 0
        self.solo = "forward" if evaluating else self.solo

    def forward_failed(self, exc: Exception, in_backward: bool) -> Exception:
        """What a forward that raised ``exc`` raises, after freeing what it gathered unless a backward
        will (nor prefetched; one the other ranks did not join is left pending)."""
        freed = self.freed()
        if not in_backward:
            for st in self.units:
                self.free(st)
        if type(exc) is not RuntimeError:
            return exc
        return StrategyError(
            f"{self.who}: the wrapped module's forward failed: {exc}\n"
            f"If an operation received an empty (0-element) tensor, it read a sharded parameter "
            f"outside the forward of the module that owns it, so it was not gathered (not gathered "
            f"now: {freed[:5]}). With ZeRO3Model list the owner's parent class in leaf_modules or "
            "raise persistence_threshold; with FSDPModel put both modules in one unit."
        )

    def end_forward(self, in_backward: bool) -> None:
        self.start_forward(False)
        self.set_busy(in_backward)

    @contextlib.contextmanager
    def watched(self, call: str, enabled: bool) -> Iterator[None]:
        """The first gather inside the block is watched (see :meth:`_wait_for_every_rank`), named as
        ``call``: a rank calling a collective method alone (saving on rank 0 only) is named."""
        self.watch, self.watching = enabled and self.forward_wait_s > 0, call
        self.solo = call if enabled else self.solo
        try:
            yield
        finally:
            self.watch, self.watching = False, "forward"

    def free(self, st: ShardUnit) -> None:
        if st.persistent or st.flat is None or (st is self.unjoined and st.work is not None):
            return  # (the last: a gather the other ranks did not join, after its error: waiting would hang)
        if st.work is not None:
            st.work.wait()
            st.work = None
        self.by_storage.pop(st.flat.untyped_storage().data_ptr(), None)
        self.gathered_bytes -= tensor_bytes(st.flat)
        st.flat = None
        self._rest(st)

    def _rest(self, st: ShardUnit) -> None:
        """A unit not gathered: inside a forward or backward its parameters are empty tensors (an
        operation reading one outside its owner's forward fails); between uses they are parked at their
        logical shape (``numel()``, ``dim()``, ``shape`` as the plain module's, no memory held)."""
        if self.busy:
            st.unit.unbind()
        else:
            st.unit.park()

    def gather_group(self, gi: int, wait: bool = True) -> None:
        for st in self.groups[gi][1]:
            self.gather(st, wait)

    def set_busy(self, busy: bool) -> None:
        """Inside a forward or backward or not (see :meth:`_rest`)."""
        if busy == self.busy:
            return
        self.busy = busy
        for st in self.units:
            if st.flat is None:
                self._rest(st)

    def freed(self) -> list[str]:
        """Keys of the units not gathered now."""
        return [st.unit.key for st in self.units if st.flat is None]


class _GatherHook(partial[Any]):
    """One of :class:`GroupHooks`' module hooks (``eager``: once ``torch.compile`` is loaded, run eagerly,
    a graph break). A ``partial``, so no Python frame of its own for dynamo to compile before the call
    reaches ``fn``. Copying or pickling the module it is on is refused: the copy would gather into
    these shards."""

    __slots__ = ("at",)
    at: UnitGatherer

    def __new__(cls, fn: Callable[..., Any], eager: bool, at: UnitGatherer) -> _GatherHook:
        self = super().__new__(cls, torch.compiler.disable(fn) if eager else fn)
        self.at = at
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise copy_refused(self.at.who, self.at.group.rank, False)


class GroupHooks:
    """Each group of ``at_rest`` gathered by its module's forward pre-hook and freed by its forward hook
    (``reshard_after_forward``), gathered again before its gradients are computed (a hook on the
    module's outputs, after ``begin_backward()``), and the neighbouring group in forward order
    prefetched with a non-blocking all-gather (the next one in forward, the previous one in backward).

    ``reshard_after_forward``: True frees every group after its forward, False none; None (FSDP2's
    default) every group but the wrapped module's own (the root: its forward spans the whole forward,
    and backward begins by gathering it again). A forward without gradients frees every group: no
    backward will."""

    def __init__(
        self,
        at_rest: UnitGatherer,
        begin_backward: Callable[[], None],
        reshard_after_forward: bool | None,
        prefetch: bool,
        direct: tuple[nn.Module, Callable[[nn.Module, Any], None]],
    ) -> None:
        self.at_rest = at_rest
        #: the wrapped module and its first forward pre-hook (``_direct.DirectForwards``)
        self.direct = direct
        self.begin_backward = begin_backward
        self.reshard_after_forward = reshard_after_forward
        #: the groups a forward with gradients keeps gathered for their backward
        self.kept = {
            gi
            for gi, (gmod, _) in enumerate(at_rest.groups)
            if reshard_after_forward is False or (reshard_after_forward is None and gmod is direct[0])
        }
        self.prefetch = prefetch
        #: the groups in the order the first forward ran them (prefetching follows it from then on)
        self.order: list[int] = []
        self.order_done = False
        self.for_compile = self.compiled_inside = False
        self._handles: list[Any] = []
        self.install()

    def install(self) -> None:
        """(Re)install the hooks; once ``torch.compile`` is loaded, each runs eagerly (a graph break):
        they talk to the backend and swap parameter storage, which a compiled graph cannot do."""
        self.remove()
        self.for_compile = "torch._dynamo" in sys.modules
        #: the wrapped module holds compiled code, whose eager parts would compile the saved-tensor hooks
        self.compiled_inside = self.for_compile and compiled_inside(self.direct[0])
        at = self.at_rest
        for gi, (gmod, _) in enumerate(at.groups):  # gathered before the user's pre-hooks run
            hook = _GatherHook(partial(self._pre_forward, gi), self.for_compile, at)
            self._handles.append(gmod.register_forward_pre_hook(hook, prepend=True))
            hook = _GatherHook(partial(self._post_forward, gi), self.for_compile, at)
            self._handles.append(gmod.register_forward_hook(hook))
        root, before = self.direct  # installed last and prepended: before the root's own unit's gather
        self._handles.append(
            root.register_forward_pre_hook(_GatherHook(before, self.for_compile, at), prepend=True)
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def before_forward(self) -> None:
        """A forward starts: reinstall the hooks for ``torch.compile`` if it was loaded after wrapping."""
        if not self.for_compile and "torch._dynamo" in sys.modules:
            torch.compiler.disable(self.install)()

    def _neighbour(self, gi: int, step: int) -> int | None:
        if not self.prefetch or gi not in self.order:
            return None
        pos = self.order.index(gi) + step
        return self.order[pos] if 0 <= pos < len(self.order) else None

    def _pre_forward(self, gi: int, module: nn.Module, _args: Any) -> None:
        # freed after the user's forward hooks, those registered after wrapping too (torch runs them in
        # the order of this dict)
        hooks, free = MODULE_HOOKS["register_forward_hook"](module), self._handles[2 * gi + 1].id
        hooks[free] = hooks.pop(free)
        if not self.order_done and gi not in self.order:
            self.order.append(gi)
        self.at_rest.gather_group(gi)
        nxt = self._neighbour(gi, +1)
        if nxt is not None and self.order_done:
            self.at_rest.gather_group(nxt, wait=False)

    def _post_forward(self, gi: int, _module: nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, gi))
        if gi not in self.kept or not torch.is_grad_enabled():  # no backward will free it
            for st in self.at_rest.groups[gi][1]:
                self.at_rest.free(st)
            torch.clear_autocast_cache()  # its weights' copies (what backward needs is saved: _CastRef)

    def _pre_backward(self, gi: int, _grad: torch.Tensor) -> None:
        self.begin_backward()
        self.at_rest.gather_group(gi)
        prev = self._neighbour(gi, -1)
        if prev is not None and prev not in self.kept:
            self.at_rest.gather_group(prev, wait=False)
