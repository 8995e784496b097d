"""DDP: replicated parameters, gradients averaged with bucketed all-reduce during backward.

Buckets are flat units of the parameters in reverse registration order (as gradients tend to
arrive); ``param.grad`` are views into each bucket's gradient buffer, and buckets launch in index
order on every rank, as the engines require (docs/strategies.md, "How it works"). ZeRO-1 and ZeRO-2
reuse the buckets and change how each is reduced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.core.broadcast import broadcast_from_rank0
from dtlab.errors import StrategyError, real
from dtlab.models.dp._grad_guard import tensor_bytes
from dtlab.models.dp._unused import grads_filled
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.flat import FlatUnit, copy_grad, reshaped_error

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["BucketOptions", "DDPModel", "DDPOptions", "DataParallelOptions", "ReduceOptions"]


class ReduceOptions(TypedDict, total=False):
    """The options every data-parallel strategy takes but ``world`` (a composition passes its mesh's
    backend as ``world``): see :class:`~dtlab.models.DDPModel`."""

    reduce_dtype: torch.dtype | None
    find_unused_parameters: bool
    broadcast_buffers: bool


class DataParallelOptions(ReduceOptions, total=False):
    """The options every data-parallel strategy takes (see :class:`~dtlab.models.DDPModel`)."""

    world: CommunicationBackend | None


class BucketOptions(ReduceOptions, total=False):
    """DDP's options but ``world``: what a composition running DDP or ZeRO-1/2 over dp passes on."""

    bucket_cap_mb: float


class DDPOptions(DataParallelOptions, BucketOptions, total=False):
    """DDP's options (ZeRO-1 and ZeRO-2 take them too)."""


class DDPModel(DataParallelModel):
    """Data parallelism with replicated parameters, gradients and optimizer state.

    Args:
        module: the model; every rank must build it with the same structure (values come from rank 0).
        backend: the data-parallel group.
        bucket_cap_mb: gradient bucket size in MiB (default 25, like torch DDP).
        reduce_dtype: dtype gradients travel and are summed in (e.g. ``torch.float32`` for bf16 params).
        find_unused_parameters: reduce zeros for parameters that got no gradient instead of raising.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to all ranks every forward
            with gradients (a forward under no_grad communicates nothing, as torch's DDP).
    """

    strategy_name: ClassVar[str] = "ddp"
    keeps_whole_grads: ClassVar[bool] = True
    module_copies: ClassVar[bool] = True
    #: reductions left in flight when a bucket launches (0: any number, waited at the end of backward);
    #: ZeRO-2 waits for the one before, so at most two transient buckets are alive at once
    max_in_flight: ClassVar[int] = 0

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[DataParallelOptions],
    ) -> None:
        cap_mb = real(bucket_cap_mb)
        if cap_mb is None or not 0 < cap_mb < 2**40:
            raise ValueError(
                f"bucket_cap_mb must be a number of megabytes > 0 (torch's default 25), got {bucket_cap_mb!r}"
            )
        super().__init__(module, backend, **options)
        self.bucket_cap_mb = float(cap_mb)
        cap = int(cap_mb * 1024 * 1024)
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        size = 0
        for name, param in reversed(self._trainable):
            nbytes = tensor_bytes(param)
            if groups[-1] and (size + nbytes > cap or groups[-1][0][1].dtype != param.dtype):
                groups.append([])
                size = 0
            groups[-1].append((name, param))
            size += nbytes
        self._units = [
            FlatUnit(f"bucket{i}", g, backend.world_size, backend.rank) for i, g in enumerate(groups)
        ]
        self._data = [u.new_flat() for u in self._units]
        for unit, flat in zip(self._units, self._data, strict=True):
            unit.copy_params_into(flat)
            unit.bind(flat)  # the parameters are views of the bucket: the broadcast below updates them
        broadcast_from_rank0(
            [*self._data, *(q.data for _, q in self._frozen), *self.module.buffers()], self.dp_backend
        )
        self._slot_of = {id(q): (i, j) for i, u in enumerate(self._units) for j, q in enumerate(u.params)}
        self._params = [q for u in self._units for q in u.params]
        self._shapes = [s.shape for u in self._units for s in u.slots]
        #: each bucket's gradient buffer, ``param.grad`` views into it (none under ZeRO-2: shards only)
        self._grad_bufs = [u.new_flat() for u in self._units] if self.keeps_whole_grads else []
        self._synced_grads = self._grad_bufs
        # a .grad left from before wrapping adds into the first synchronized gradient, as under torch's
        # DDP: copied into its bucket here (ZeRO-2 leaves it in param.grad, as inside no_sync())
        for unit, buf in zip(self._units, self._grad_bufs, strict=False):
            unit.grads_into(buf)
        if self.keeps_whole_grads:
            self._point_grads()
        self._ready: list[set[int]] = [set() for _ in self._units]
        self._next_launch = 0
        self._works: list[tuple[int, Work, Any]] = []
        self._register_grad_hooks(self._on_grad)

    # ------------------------------------------------------------------ forward / backward
    def _release_guards(self) -> None:
        if self._guarded and self.keeps_whole_grads:
            self._point_grads()
        super()._release_guards()

    def _point_grads(self) -> None:
        """Make every ``param.grad`` a view of its bucket's gradient buffer (again; ZeRO-2: None)."""
        if not self.keeps_whole_grads:
            return super()._point_grads()
        for unit, buf in zip(self._units, self._grad_bufs, strict=True):
            for q, view in zip(unit.params, unit.views(buf), strict=True):
                q.grad = view

    def _before_forward(self, *args: Any) -> None:
        """Also refuse, before a forward with gradients, a parameter whose ``.data`` was replaced by a
        tensor of another shape since wrapping (``resize_token_embeddings`` on the wrapped model): its
        gradient would not fit its place in the bucket (autograd's raw size error in backward)."""
        super()._before_forward(*args)
        if torch.is_grad_enabled() and list(map(torch.Tensor.size, self._params)) != self._shapes:
            for unit in self._units:
                for q, s in zip(unit.params, unit.slots, strict=True):
                    if q.shape != s.shape:
                        raise reshaped_error(self._wrapped_as.who, s.name, q.shape, s.shape)

    def _fills_no_grads(self) -> bool:
        """A backward beginning that fills no ``.grad`` (``torch.autograd.grad``): nothing to reduce."""
        return not self._backward.open and grads_filled(p for _, p in self._trainable) is not True

    def _begin_backward(self) -> None:
        if not self._fills_no_grads():
            super()._begin_backward()
        else:  # a gradient penalty's autograd.grad pass is not synchronized; a pass whose parameters are
            self._backward.watch_outer()  # all in reentrant checkpoints is, when it ends

    def _on_grad(self, param: nn.Parameter) -> None:
        self._begin_backward()
        i = self._slot_of[id(param)][0]
        if self._sync and id(param) in self._ready[i]:  # its bucket may be averaged already: refuse
            name = self._name_of[id(param)]
            raise StrategyError(
                f"{type(self).__name__} on rank {self.dp_backend.rank}: parameter {name!r} received its "
                "gradient twice in one backward pass: it is used both inside and outside a "
                "torch.utils.checkpoint(..., use_reentrant=True) segment, whose backward runs as a backward "
                "of its own, so the second part would be added to an average already taken. Pass "
                "use_reentrant=False (torch's recommended mode), or use dtlab's checkpoint_modules()"
            )
        self._store_grad(i, param)
        if self._sync:
            self._ready[i].add(id(param))
            self._launch_ready()

    def _store_grad(self, i: int, param: nn.Parameter) -> None:
        """Keep ``param.grad`` a view of bucket ``i`` (autograd may have replaced it)."""
        s = self._units[i].slots[self._slot_of[id(param)][1]]
        view = self._grad_bufs[i][s.offset : s.offset + s.numel]
        grad = param.grad
        if grad is None or grad.is_sparse or grad.data_ptr() != view.data_ptr():
            if grad is not None:
                copy_grad(view.view(s.shape), grad)
            else:  # set to None since (model.zero_grad()): no gradient, not the bucket's last
                view.zero_()
            param.grad = view.view(s.shape)

    def _launch_ready(self) -> None:
        """Launch, in index order, every complete bucket from the next one not launched."""
        units = self._units
        while self._next_launch < len(units) and len(self._ready[self._next_launch]) == len(
            units[self._next_launch].params
        ):
            i = self._next_launch
            self._works.append((i, *self._launch(i)))
            self._next_launch += 1
            if self.max_in_flight:
                self._complete_launched(keep=self.max_in_flight)

    def _complete_launched(self, keep: int) -> None:
        """Wait for the oldest launched reductions (every rank launched them before its later ones) and
        complete them, until ``keep`` are left in flight."""
        while len(self._works) > keep:
            i, work, extra = self._works.pop(0)
            work.wait()
            self._complete(i, extra)

    def _launch(self, i: int) -> tuple[Work, Any]:
        return self._reducer.all_reduce(self._units[i].key, self._grad_bufs[i]), None

    def _complete(self, i: int, extra: Any) -> None:
        """Called after bucket ``i``'s reduction finished (ZeRO-2 keeps its shard here)."""

    def _flush(self, fill_missing: bool) -> None:
        """Launch the buckets not launched yet and wait for all (a parameter that got no gradient: what
        its buffer holds if ``fill_missing``)."""
        missing = [(i, q) for i, u in enumerate(self._units) for q in u.params if id(q) not in self._ready[i]]
        try:
            if missing and not fill_missing:
                raise self._unused_error([self._name_of[id(q)] for _, q in missing])
            for i, q in missing:
                if q.grad is None and self.keeps_whole_grads:  # set to None since (model.zero_grad())
                    self._used.forget(q)
                self._store_grad(i, q)
                self._ready[i].add(id(q))
            self._launch_ready()
            self._complete_launched(keep=0)
            self._grads_synced = True
        finally:
            self._end_step()

    def _abandon_backward(self) -> None:
        try:
            for _, work, _ in self._works:
                work.wait()  # nothing writes into a bucket once zero_grad() cleared it
        finally:
            self._end_step()

    def _end_step(self) -> None:
        """A reduction ended, completed or not: no bucket is ready or launched (ZeRO-2: nor filled)."""
        self._works = []
        self._ready = [set() for _ in self._units]
        self._next_launch = 0

    # ------------------------------------------------------------------ composition
    def whole_grads(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, gradient)`` of every trainable parameter as views of the gradient buckets, whatever
        ``param.grad`` shows (after a reduce-scatter: a stand-in refusing partial use)."""
        return [
            (self._name_of[id(q)], view)
            for unit, buf in zip(self._units, self._grad_bufs, strict=False)  # none under ZeRO-2
            for q, view in zip(unit.params, unit.views(buf), strict=True)
        ]

    # ------------------------------------------------------------------ optimizer protocol
    def shard_units(self) -> list[FlatUnit]:
        return list(self._units)

    def _bucket(self, unit: FlatUnit) -> int:
        """``unit``'s index among the buckets (a unit of another model refused, naming it)."""
        for i, mine in enumerate(self._units):
            if mine is unit:
                return i
        raise ValueError(f"unit {unit.key} does not belong to this model: pass one of its shard_units()")

    def shard_param(self, unit: FlatUnit) -> torch.Tensor:
        return unit.own_shard(self._data[self._bucket(unit)])

    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        """Before a sharded optimizer's step, which updates the bucket: a parameter whose ``.data`` was
        replaced since wrapping (``p.data = t`` on every rank, ``vector_to_parameters``) is written into
        its place in the bucket and views it again, as under DDP; one of another shape is refused."""
        data = self._data[self._bucket(unit)]
        bucket = data.untyped_storage().data_ptr()
        slots = zip(unit.params, unit.slots, strict=True)
        moved = [(q, s) for q, s in slots if q.untyped_storage().data_ptr() != bucket]
        for q, s in moved:
            if q.shape != s.shape:
                raise reshaped_error(type(self).__name__, s.name, q.shape, s.shape)
        if moved:  # (the others' values copied onto themselves)
            unit.copy_params_into(data)
            unit.bind(data)
        grad = self._synced_grads[self._bucket(unit)]  # ZeRO-2: this rank's shard already
        return unit.own_shard(grad) if self.keeps_whole_grads else grad

    def gather_updated_shards(self) -> None:
        """After a sharded optimizer step: every rank's updated shard to every rank (all-gather)."""
        for unit, flat in zip(self._units, self._data, strict=True):
            self.dp_backend.all_gather(flat, unit.own_shard(flat).clone())

    # ------------------------------------------------------------------ memory
    def _held_bytes(self) -> tuple[int, int, int]:
        # the distinct storages: each bucket (parameters are views into it) and frozen parameter once
        storages = [q.untyped_storage() for q in self.module.parameters() if q.numel()]
        params = sum({st.data_ptr(): st.nbytes() for st in storages}.values())
        return params, self._grad_bytes(), params

    def _grad_bytes(self) -> int:
        return sum(tensor_bytes(g) for g in self._synced_grads)
