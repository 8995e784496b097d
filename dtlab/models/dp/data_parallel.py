"""What DDP, ZeRO-1/2/3 and FSDP share (the reducer, ``no_sync``, the end-of-backward flush, buffer
broadcast, gradient stand-ins and buffers, state and memory reports), and the methods a composition uses
a data-parallel strategy through (``HybridShardedModel`` wraps each pipeline rank's stages in one)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtlab.backends.base import CommunicationBackend
from dtlab.core import pairs
from dtlab.core.backward import BackwardPass
from dtlab.core.broadcast import broadcast_from_rank0
from dtlab.core.placement import Placement, Replicate
from dtlab.core.reducer import DenseReducer, GradientReducer, check_reduce_dtype
from dtlab.core.shard_index import new_state
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError, check_switches
from dtlab.models.base import AttachedOptimizer, OptimizerTarget
from dtlab.models.dp._grad_guard import ShardedGradient, adopt_cleared, sharded_grad_message, tensor_bytes
from dtlab.models.dp._owner import (
    SWITCH_ADVICE,
    Ownership,
    check_module,
    check_types,
    rewrap_advice,
    torch_option_refused,
)
from dtlab.models.dp._torch_methods import TorchMethods
from dtlab.models.dp._unused import UsedParams, unused_error
from dtlab.models.placed_state import load_placed_state, write_placed_state

if TYPE_CHECKING:
    from dtlab.models.placed_state import FlatShard

__all__ = ["DataParallelModel"]


class DataParallelModel(TorchMethods, OptimizerTarget):
    """Base of the five data-parallel model strategies (see DDPModel and friends for the options)."""

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        reduce_dtype: torch.dtype | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        world: CommunicationBackend | None = None,
        **unknown: Any,  # torch DDP's device_ids=, static_graph=...: named with the fix
    ) -> None:
        if unknown and (refused := torch_option_refused(type(self).__name__, unknown)) is not None:
            raise refused
        check_types(module, backend, type(self).__name__)
        check_switches(find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers)
        super().__init__(module, backend, world=world)
        self._trainable = check_module(module, backend, type(self).__name__)
        check_reduce_dtype(reduce_dtype)
        #: the claim on the module's parameters: the newest wrapper of them owns them (claimed with the
        #: gradient hooks); a module another wrapper keeps sharded is refused here, before any change
        self._owner = Ownership(type(self).__name__, module, backend, self.shards_at_rest)
        self._owner.check_free()
        self.register_forward_pre_hook(self._before_forward)
        self.register_forward_hook(self._after_forward)
        self._reducer: GradientReducer = DenseReducer(backend, reduce_dtype)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._name_of = {id(p): n for n, p in self._trainable}
        self._sync = True
        self._backward = BackwardPass()  # open from the first gradient hook; raised partway: partial grads
        self._backward_synced = False  # whether the last backward started synchronized
        self._grads_synced = False
        self._optimizer_ref: AttachedOptimizer | None = None
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._guarded = False
        #: the tensors holding the synchronized gradient: DDP's and ZeRO-1's whole buckets, else this
        #: rank's shards
        self._synced_grads: list[torch.Tensor] = []
        self._post_sync: list[Callable[[], None]] = []
        #: what got a gradient since zero_grad() here (a pipeline refuses the rest) or, all-reduced with
        #: find_unused_parameters, on any rank (what none used is left out of the step, as in torch)
        self._used = UsedParams(self._trainable, backend, self.find_unused_parameters)
        if self.find_unused_parameters:
            self._post_sync.append(self._used.sync)

    # ------------------------------------------------------------------ reducer
    @property
    def gradient_reducer(self) -> GradientReducer:
        return self._reducer

    @gradient_reducer.setter
    def gradient_reducer(self, reducer: GradientReducer) -> None:
        if not isinstance(reducer, GradientReducer):
            raise TypeError(f"gradient_reducer must be a GradientReducer, got {type(reducer).__name__}")
        if reducer.backend.world_size != self.dp_backend.world_size:
            raise ValueError(
                f"the reducer works on {reducer.backend.world_size} ranks but this model's data-parallel "
                f"group has {self.dp_backend.world_size}; build the reducer on model.dp_backend"
            )
        self._reducer = reducer

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's switch: ``False``: backward passes accumulate locally (as in :meth:`no_sync`)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"require_backward_grad_sync must be a bool, got {value!r}")
        self._sync = value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block accumulate gradients locally; the first one after it syncs."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _after_forward(self, _m: nn.Module, _a: Any, out: Any) -> None:
        """A hook on the outputs begins the backward where it starts: the end-of-backward flush is then
        queued on the user's backward, not on a nested one (``checkpoint(..., use_reentrant=True)``
        runs its segment's backward as a backward of its own, which ends first)."""
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _grad: self._begin_backward())

    def _begin_backward(self) -> None:
        """A backward's first gradient hook (an output's or a parameter's): queue its end flush once."""
        if not self._backward.begin(self._end_backward_guarded):
            return
        self._backward_synced = self._sync
        if self._sync:  # a no_sync() backward reduces nothing: not a step for the reducer
            self._reducer.start_step()

    def _end_backward_guarded(self) -> None:
        synced = self._sync
        try:
            self._end_backward()
        finally:
            self._backward.end()
        if synced:
            self._after_synchronized()

    def _after_synchronized(self) -> None:
        """The gradients are synchronized (ZeRO-1/2/3 and FSDP guard their shards first)."""
        for fn in self._post_sync:
            fn()

    # ------------------------------------------------------------------ composition
    @property
    def grads_synced(self) -> bool:
        """Whether the gradients hold a synchronized backward's average (until the step or zero_grad)."""
        return self._grads_synced

    #: whether the parameters are kept as flat shards (ZeRO-3, FSDP): no newer wrapper can take them over
    shards_at_rest: ClassVar[bool] = False

    def _before_forward(self, *_: Any) -> None:
        """Before a forward: refuse it once a newer wrapper of the same module took it over, or while the
        gradients are partial after a backward that raised (an evaluation forward only cleans up); drop
        the gradient stand-ins before a forward with gradients, and broadcast rank 0's buffers then (as
        torch's DDP: a forward under no_grad communicates nothing, so one rank may evaluate alone)."""
        self._owner.check("forward")
        self._wrapped_as.check()
        self._check_backward_finished("the forward" if torch.is_grad_enabled() else None)
        adopt_cleared(self._guarded, type(self).__name__, self._trainable, self.zero_grad_buffers)
        if torch.is_grad_enabled():
            self._release_guards()
            if self.broadcast_buffers:
                broadcast_from_rank0(self.module.buffers(), self.dp_backend)

    # ------------------------------------------------------------------ a backward that raised
    def _check_backward_finished(self, refused: str | None) -> None:
        """Refuse ``refused`` (a forward, a step; None: only clean up) after a backward that raised
        partway. Such a backward never reaches its end (autograd runs the queued end-of-backward
        callback only when the whole pass succeeds): outside any backward its bookkeeping is found still
        open here, so the reductions it launched are waited for (every rank raised at the same point and
        launched the same ones), gathered units freed and per-step state cleared; the gradients stay
        partial until ``zero_grad()``."""
        if self._backward.found_raised():
            self._abandon_backward()
            if self._backward_synced:  # a reducer keeping state across steps undoes that step or refuses
                self._reducer.discard_step()
        produced = "some gradients were produced (and, outside no_sync(), some reduced)"
        self._backward.refuse(f"{type(self).__name__} on rank {self.dp_backend.rank}", refused, produced)

    def _abandon_backward(self) -> None:
        """Wait for what a backward that raised launched and clear its per-step state."""
        raise NotImplementedError

    #: whether ``param.grad`` are whole (views of whole buckets: DDP, ZeRO-1), not only flat shards
    keeps_whole_grads: ClassVar[bool] = False

    def whole_grads(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, gradient)`` of each trainable parameter with a whole one (:attr:`keeps_whole_grads`)."""
        return [(n, p.grad) for n, p in self._trainable if p.grad is not None]

    def register_post_sync_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` after every synchronization of the gradients (a synchronized backward or
        :meth:`reduce_accumulated_grads`), e.g. a sum over another mesh axis."""
        self._post_sync.append(fn)

    def reduce_accumulated_grads(self, *, unused_checked: bool = False) -> None:
        """Average now, over the dp group through the reducer, the gradients accumulated inside
        ``no_sync()`` (a pipeline schedule's), as a synchronized backward would (inside ``no_sync()`` too).
        Without ``find_unused_parameters`` a parameter that got no gradient since ``zero_grad()`` on any
        rank is refused first on every rank, unless ``unused_checked`` (by a pipeline's step)."""
        self._owner.check("reduce_accumulated_grads()")
        self._check_backward_finished("reduce_accumulated_grads()")
        if not (self.find_unused_parameters or unused_checked):  # a layer replaced or frozen: named first
            checks = (self._owner.check_added, self.check_requires_grad)
            self._used.refuse_unused(type(self).__name__, self.keeps_whole_grads, checks)
        prev, self._sync = self._sync, True
        try:
            self._reducer.start_step()
            self._flush(fill_missing=True)
        finally:
            self._sync = prev
        self._after_synchronized()

    @contextlib.contextmanager
    def keep_gathered(self, when: str = "gathering the parameters") -> Iterator[None]:  # noqa: ARG002 - ZeRO-3/FSDP's
        """Inside the block, parameters sharded at rest stay gathered after their first use (``when``: the
        use named if a write into a parked parameter is found first)."""
        yield

    @contextlib.contextmanager
    def gather_hooks_suspended(self) -> Iterator[None]:
        """Inside the block, forward runs without gathering (a forward on the meta device)."""
        yield

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The tensors held whole here, keyed like ``module.state_dict()`` (not ZeRO-3/FSDP's shards)."""
        return dict(self.module.state_dict(keep_vars=True))

    def flat_shards(self) -> list[FlatShard]:
        """The flat units sharded at rest with this rank's shard (ZeRO-3/FSDP)."""
        return []

    def _end_backward(self) -> None:
        if self._sync:
            self._flush(fill_missing=self.find_unused_parameters)

    def _flush(self, fill_missing: bool) -> None:
        """Reduce every gradient not reduced yet and wait for all. A parameter that got no gradient is
        reduced with what it holds if ``fill_missing`` (zeros, or what ``no_sync()`` kept), else refused."""
        raise NotImplementedError

    def _guard_grads(self) -> None:
        """After a synchronized backward whose gradients stay sharded: ``param.grad`` refuses use."""
        opt = pairs.optimizer_class_name(pairs.default_optimizer(self.strategy_name))
        for name, p in self._trainable:
            p.grad = ShardedGradient(p, sharded_grad_message(name, type(self).__name__, opt))
        self._guarded = True

    def _release_guards(self) -> None:
        """Before the next forward or backward: drop the stand-ins put by :meth:`_guard_grads` (a real
        ``.grad`` set since is left alone)."""
        if self._guarded:
            self._guarded = False
            for _, p in self._trainable:
                if isinstance(p.grad, ShardedGradient):
                    p.grad = None

    def check_requires_grad(self) -> None:
        """Refuse parameters whose ``requires_grad`` changed after wrapping: the strategy laid out
        gradient buffers and shards for the parameters trainable then, so a parameter unfrozen later
        would never be synchronized or stepped, and one frozen later would hang the reduction."""
        unfrozen = [n for n, p in self._frozen if p.requires_grad]
        frozen = [n for n, p in self._trainable if not p.requires_grad]
        what = [f"requires_grad=True now on {unfrozen[:5]} (frozen when wrapped)"] if unfrozen else []
        what += [f"requires_grad=False now on {frozen[:5]} (trainable when wrapped)"] if frozen else []
        if what:
            raise StrategyError(
                f"{type(self).__name__}: {'; '.join(what)}. The strategy lays out gradient buffers and "
                "shards for the parameters that require grad when it wraps the module, so a change "
                "after wrapping would leave a parameter untrained or hang the reduction. Set "
                f"requires_grad on the plain module before wrapping it ({rewrap_advice(self.shards_at_rest)})"
            )

    def _unused_error(self, missing: list[str]) -> StrategyError:
        self._owner.check_added()  # a layer replaced after wrapping: its new parameters named
        self.check_requires_grad()
        return unused_error(type(self).__name__, self.dp_backend.rank, missing)

    def _register_grad_hooks(self, fn: Callable[[nn.Parameter], None]) -> None:
        self._owner.claim()  # a previous wrapper of these parameters stops reducing their gradients
        hook = cast("Callable[[torch.Tensor], None]", self._used.marking(fn))  # called with the parameter
        for _, p in self._trainable:
            self._owner.keep(p.register_post_accumulate_grad_hook(hook))

    # ------------------------------------------------------------------ optimizer protocol
    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._trainable)

    def attach_optimizer(self, optimizer: AttachedOptimizer) -> None:
        self._owner.check("an optimizer")
        if self._optimizer_ref is not None and self._optimizer_ref is not optimizer:
            raise StrategyError(
                f"{type(self).__name__} already has an optimizer strategy "
                f"({type(self._optimizer_ref).__name__}); {SWITCH_ADVICE}"
            )
        self._optimizer_ref = optimizer

    def check_grads_ready(self, who: str) -> None:
        self._owner.check(f"{who}.step()")
        self._check_backward_finished(f"{who}.step()")
        self._owner.check_added()
        self.check_requires_grad()
        self._wrapped_as.check()
        adopt_cleared(self._guarded, type(self).__name__, self._trainable, self.zero_grad_buffers)
        if not self._grads_synced:
            raise StrategyError(
                f"{who}.step() found no synchronized gradients: call loss.backward() (under a pipeline "
                "model.train_step(batch, loss_fn)) outside no_sync() (after the forward of this model) "
                "before step(), and zero_grad() after it"
            )

    def after_optimizer_step(self) -> None:
        self._grads_synced = False

    def zero_grad_buffers(self, set_to_none: bool = True) -> None:
        self._owner.check("zero_grad()")  # it would point param.grad back into its own buffers
        self._check_backward_finished(None)  # a backward that raised: cleaned up, its gradients dropped
        self._backward.forget()
        self._guarded = False
        torch._foreach_zero_(self._synced_grads)
        self._point_grads()
        self._grads_synced = False
        self._used.clear(set_to_none)

    def unused_params(self) -> frozenset[int]:
        return self._used.unused if self.find_unused_parameters else frozenset()

    def unused_here(self) -> list[str]:
        """The trainable parameters no backward on this rank gave a gradient since ``zero_grad()``."""
        return self._used.unused_here(self.keeps_whole_grads)

    def _point_grads(self) -> None:
        """After ``zero_grad()``: ``param.grad`` is None (DDP, ZeRO-1: a view of its bucket again)."""
        for _, q in self._trainable:
            q.grad = None

    def scale_grads_(self, factor: float) -> None:
        torch._foreach_mul_(self._synced_grads, factor)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        return list(self._synced_grads), self.keeps_whole_grads

    def grad_norm_group(self) -> CommunicationBackend:
        return self.dp_backend

    def placed(self, name: str) -> tuple[Placement, int, int]:  # noqa: ARG002 - every parameter of a data-parallel strategy is replicated
        return Replicate(), 0, 1

    # ------------------------------------------------------------------ state and memory
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self.keep_gathered("full_state_dict()"):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def sharded_state_dict(self) -> ShardedState:
        self._check_backward_finished(None)  # a backward that raised is noticed: its reducer step discarded
        state = new_state(self.strategy_name, self.dp_backend.world_size, self.dp_backend.rank)
        return write_placed_state(state, self.whole_state(), self.flat_shards(), {}, self.dp_backend)

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        load_placed_state(shards, self.whole_state(), self.flat_shards(), {}, self.dp_backend)

    def memory_report(self) -> dict[str, int]:
        params, grads, peak = self._held_bytes()
        opt = self._optimizer_ref
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": 0 if opt is None else opt.state_bytes(),
            "buffers": sum(tensor_bytes(b) for b in self.module.buffers()),
            "peak_gathered_parameters": peak,
        }

    def _held_bytes(self) -> tuple[int, int, int]:
        """Bytes of the parameters and gradients held here, and the peak of gathered ones in the last step."""
        raise NotImplementedError
