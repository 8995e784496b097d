"""The one interface every layer above talks to: :class:`CommunicationBackend`.

Public methods validate their arguments, call the engine (the ``_``-prefixed methods a concrete
backend implements) and record what this rank sent and received in :attr:`CommunicationBackend.stats`.
Validation (the ``_check_*`` methods, in ``_checks.py``) and byte accounting live here, once, so
every engine reports the same numbers for the same call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from time import perf_counter

import torch

from dtlab.backends._checked import CallChecks, CheckState, checks_from_env
from dtlab.backends._checks import _AVG, _SUPPORTED, ArgumentChecks
from dtlab.backends._groups import GroupMaking, split_members
from dtlab.backends._objects import ObjectExchange
from dtlab.backends.stats import CommStats
from dtlab.backends.types import SUPPORTED_DTYPES, CompletedWork, P2POp, ReduceOp, Work
from dtlab.errors import ArgumentError

__all__ = [
    "SUPPORTED_DTYPES",
    "CommunicationBackend",
    "CompletedWork",
    "P2POp",
    "ReduceOp",
    "Work",
    "split_members",
]


class CommunicationBackend(ArgumentChecks, CallChecks, ObjectExchange, GroupMaking, ABC):
    """Collectives, point-to-point and object exchange among ``world_size`` ranks.

    Vocabulary and in-place contracts follow ``torch.distributed``. Byte counters follow the ring
    convention (see ``docs/backends.md``): with ``P`` ranks and ``n`` bytes, ``all_reduce`` sends and
    receives ``2(P-1)/P * n``; ``reduce_scatter`` and ``all_gather`` ``(P-1)/P`` of the full buffer;
    ``broadcast``/``reduce`` run along a chain starting (ending) at the root; point-to-point counts
    the message.
    """

    #: True for an engine that compares every call itself (the in-memory world): checked mode is a no-op
    _checks_calls_itself: bool = False

    def __init__(self, rank: int, world_size: int, stats_parent: CommStats | None = None) -> None:
        if world_size < 1:
            raise ArgumentError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")
        self._rank = rank
        self._world_size = world_size
        self._stats = CommStats(parent=stats_parent)
        self._checked = not self._checks_calls_itself and checks_from_env()
        self._check_state: CheckState | None = None  # made at the first checked collective
        # the hot collectives test the common case in one inline expression and call the checks only
        # when it fails; an engine that adds checks of its own (NCCL: CUDA tensors only) always gets them
        cls = type(self)
        self._inline_checks = all(
            getattr(cls, name) is getattr(CommunicationBackend, name)
            for name in ("_check_tensor", "_check_op", "_check_reduce_scatter", "_check_all_gather")
        )

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where this rank's tensors live (``cpu`` or ``cuda:i``)."""

    @property
    def stats(self) -> CommStats:
        """Per kind of operation: calls, bytes sent and bytes received by this rank."""
        return self._stats

    @property
    def check_collectives(self) -> bool:
        """Checked mode: before each collective the ranks compare what they call (kind, shape, dtype,
        op, root; one all-gather of 16 ints each) and a difference raises ``CollectiveMismatchError``
        on every rank. Default: ``DTLAB_CHECK_COLLECTIVES``; groups inherit their parent's setting."""
        return self._checked or self._checks_calls_itself

    @check_collectives.setter
    def check_collectives(self, on: bool) -> None:
        self._checked = bool(on) and not self._checks_calls_itself

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{self.name}(rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` over all ranks, in place, on every rank."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype in _SUPPORTED
            and tensor.is_contiguous()
            and op.__class__ is ReduceOp
            and (op is not _AVG or tensor.is_floating_point())
        ):
            self._check_tensor(tensor, "all_reduce")
            self._check_op(tensor, op, "all_reduce")
        if self._checked:
            self._agree(("all_reduce", tensor.shape, tensor.dtype, op))
        t0 = perf_counter()
        self._all_reduce(tensor, op)
        dt = perf_counter() - t0
        p = self._world_size
        moved = 2 * (p - 1) * tensor.nbytes // p
        self._stats.record("all_reduce", moved, moved, dt)

    # ------------------------------------------------------------------ non-blocking collectives
    def iall_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Non-blocking ``all_reduce``; ``tensor`` holds the result once ``wait()`` returns.

        Engines that cannot overlap (in-memory) complete it before returning. Bytes are counted at
        the call; ``stats`` seconds measure the call, not the wait.
        """
        self._check_tensor(tensor, "iall_reduce")
        self._check_op(tensor, op, "iall_reduce")
        if self._checked:
            self._agree(("all_reduce", tensor.shape, tensor.dtype, op))
        t0 = perf_counter()
        work = self._iall_reduce(tensor, op)
        dt = perf_counter() - t0
        p, n = self.world_size, tensor.nbytes
        moved = 2 * (p - 1) * n // p
        self._stats.record("all_reduce", moved, moved, dt)
        return work

    def ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Non-blocking ``reduce_scatter`` (same contract); complete it with ``wait()``."""
        self._check_reduce_scatter(output, input, op)
        if self._checked:
            self._agree(("reduce_scatter", output.numel(), output.dtype, op))
        t0 = perf_counter()
        work = self._ireduce_scatter(output, input, op)
        dt = perf_counter() - t0
        moved = (self.world_size - 1) * output.nbytes
        self._stats.record("reduce_scatter", moved, moved, dt)
        return work

    def iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Non-blocking ``all_gather`` (same contract); complete it with ``wait()``."""
        self._check_all_gather(output, input)
        if self._checked:
            self._agree(("all_gather", input.numel(), input.dtype))
        t0 = perf_counter()
        work = self._iall_gather(output, input)
        dt = perf_counter() - t0
        moved = (self.world_size - 1) * input.nbytes
        self._stats.record("all_gather", moved, moved, dt)
        return work

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` over all ranks into rank ``dst``'s tensor; others keep theirs."""
        self._check_tensor(tensor, "reduce")
        self._check_root(dst, "reduce", "dst")
        self._check_op(tensor, op, "reduce")
        if self._checked:
            self._agree(("reduce", tensor.shape, tensor.dtype, op, dst))
        t0 = perf_counter()
        self._reduce(tensor, dst, op)
        dt = perf_counter() - t0
        # chain (dst+1) -> (dst+2) -> ... -> dst: everyone but dst sends, everyone but the start receives
        p, n = self.world_size, tensor.nbytes
        start = (dst + 1) % p
        sent = n if (p > 1 and self.rank != dst) else 0
        received = n if (p > 1 and self.rank != start) else 0
        self._stats.record("reduce", sent, received, dt)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        self._check_tensor(tensor, "broadcast")
        self._check_root(src, "broadcast", "src")
        if self._checked:
            self._agree(("broadcast", tensor.shape, tensor.dtype, src))
        t0 = perf_counter()
        self._broadcast(tensor, src)
        dt = perf_counter() - t0
        # chain src -> src+1 -> ... -> src-1: everyone but the last sends, everyone but src receives
        p, n = self.world_size, tensor.nbytes
        last = (src - 1) % p
        sent = n if (p > 1 and self.rank != last) else 0
        received = n if (p > 1 and self.rank != src) else 0
        self._stats.record("broadcast", sent, received, dt)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """``input`` holds ``world_size * output.numel()`` elements; rank r gets the reduced r-th chunk."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(output, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and output.dtype is input.dtype
            and output.dtype in _SUPPORTED
            and output.is_contiguous()
            and input.is_contiguous()
            and input.numel() == self._world_size * output.numel()
            and op.__class__ is ReduceOp
            and (op is not _AVG or output.is_floating_point())
        ):
            self._check_reduce_scatter(output, input, op)
        if self._checked:
            self._agree(("reduce_scatter", output.numel(), output.dtype, op))
        t0 = perf_counter()
        self._reduce_scatter(output, input, op)
        dt = perf_counter() - t0
        moved = (self._world_size - 1) * output.nbytes
        self._stats.record("reduce_scatter", moved, moved, dt)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` receives ``world_size * input.numel()`` elements: every rank's input in rank order."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(output, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and output.dtype is input.dtype
            and output.dtype in _SUPPORTED
            and output.is_contiguous()
            and input.is_contiguous()
            and output.numel() == self._world_size * input.numel()
        ):
            self._check_all_gather(output, input)
        if self._checked:
            self._agree(("all_gather", input.numel(), input.dtype))
        t0 = perf_counter()
        self._all_gather(output, input)
        dt = perf_counter() - t0
        moved = (self._world_size - 1) * input.nbytes
        self._stats.record("all_gather", moved, moved, dt)

    def all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Variable-sized all-gather: each rank contributes ``input.numel()`` elements (may differ).

        Returns the flat concatenation of every rank's input in rank order and the per-rank counts.
        All ranks must pass the same dtype.
        """
        self._check_tensor(input, "all_gather_v", "input")
        if self._checked:
            self._agree(("all_gather_v", input.dtype))
        t0 = perf_counter()
        output, counts = self._all_gather_v(input.reshape(-1))
        dt = perf_counter() - t0
        sent, received = self._all_gather_v_bytes(counts, input.element_size())
        self._stats.record("all_gather_v", sent, received, dt)
        return output, counts

    def _all_gather_v_bytes(self, counts: list[int], element_size: int) -> tuple[int, int]:
        """Bytes ``all_gather_v`` moved on this rank: a ring over the real counts (an engine with a
        variable-sized all-gather); engines that pad every contribution override it."""
        # rank r forwards every chunk but its successor's and receives every chunk but its own;
        # plus the exchange of the counts (one int64 per rank)
        p, total = self.world_size, sum(counts)
        sent = (total - counts[(self.rank + 1) % p]) * element_size + 8 * (p - 1)
        received = (total - counts[self.rank]) * element_size + 8 * (p - 1)
        return sent, received

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        """``inputs[j]`` goes to rank j; ``outputs[i]`` receives what rank i sent to this rank."""
        p = self.world_size
        if len(outputs) != p or len(inputs) != p:
            raise ArgumentError(
                f"all_to_all needs world_size={p} output and input tensors, got "
                f"{len(outputs)} outputs and {len(inputs)} inputs"
            )
        dtypes = {t.dtype for t in list(outputs) + list(inputs)}
        if len(dtypes) > 1:
            raise ArgumentError(
                f"all_to_all: all tensors must share one dtype, got {sorted(map(str, dtypes))}"
            )
        for i, t in enumerate(inputs):
            self._check_tensor(t, "all_to_all", f"inputs[{i}]")
        for i, t in enumerate(outputs):
            self._check_tensor(t, "all_to_all", f"outputs[{i}]")
        if self._checked:
            self._agree(("all_to_all", inputs[0].dtype))
        t0 = perf_counter()
        self._all_to_all(list(outputs), list(inputs))
        dt = perf_counter() - t0
        me = self.rank
        sent = sum(t.nbytes for j, t in enumerate(inputs) if j != me)
        received = sum(t.nbytes for i, t in enumerate(outputs) if i != me)
        self._stats.record("all_to_all", sent, received, dt)

    def barrier(self) -> None:
        """Wait until every rank reaches the barrier."""
        if self._checked:
            self._agree(("barrier",))
        t0 = perf_counter()
        self._barrier()
        dt = perf_counter() - t0
        self._stats.record("barrier", 0, 0, dt)

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst``; messages between a pair with one tag arrive in order."""
        self._check_tensor(tensor, "send")
        self._check_peer(dst, "send", "dst")
        t0 = perf_counter()
        self._send(tensor, dst, tag)
        dt = perf_counter() - t0
        self._stats.record("send", tensor.nbytes, 0, dt)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (``None``: any rank); returns the source rank."""
        self._check_tensor(tensor, "recv")
        if src is not None:
            self._check_peer(src, "recv", "src")
        t0 = perf_counter()
        source = self._recv(tensor, src, tag)
        dt = perf_counter() - t0
        self._stats.record("recv", 0, tensor.nbytes, dt)
        return source

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Non-blocking send; do not modify ``tensor`` until the handle's ``wait()`` returns."""
        self._check_tensor(tensor, "isend")
        self._check_peer(dst, "isend", "dst")
        t0 = perf_counter()
        work = self._isend(tensor, dst, tag)
        dt = perf_counter() - t0
        self._stats.record("send", tensor.nbytes, 0, dt)
        return work

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Non-blocking receive; ``wait()`` returns the source rank once ``tensor`` is filled."""
        self._check_tensor(tensor, "irecv")
        if src is not None:
            self._check_peer(src, "irecv", "src")
        t0 = perf_counter()
        work = self._irecv(tensor, src, tag)
        dt = perf_counter() - t0
        self._stats.record("recv", 0, tensor.nbytes, dt)
        return work

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Post every send and receive of ``ops`` at once; one handle per op, in order.

        All operations are started before this returns and none is waited for, so the order of the
        ops in a batch, and which rank posts its batch first, cannot deadlock (as
        ``torch.distributed.batch_isend_irecv``). Messages between one pair of ranks in one direction
        are matched in posting order (tags also keep them apart on MPI and gloo; NCCL ignores tags).
        A receive names its source. Do not touch a tensor until its handle's ``wait()`` returned.
        Bytes are counted as ``send``/``recv`` calls, one per op.
        """
        ops = list(ops)
        for i, op in enumerate(ops):
            if not isinstance(op, P2POp) or op.kind not in ("send", "recv"):
                raise ArgumentError(
                    f"batch_isend_irecv: ops[{i}] must be a P2POp of kind 'send' or 'recv' "
                    f"(P2POp.send(t, dst) / P2POp.recv(t, src)), got {op!r}"
                )
            self._check_tensor(op.tensor, "batch_isend_irecv", f"ops[{i}].tensor")
            self._check_peer(op.peer, "batch_isend_irecv", f"ops[{i}].peer")
        if not ops:
            return []
        t0 = perf_counter()
        works = self._batch_isend_irecv(ops)
        dt = (perf_counter() - t0) / len(ops)
        for op in ops:
            if op.kind == "send":
                self._stats.record("send", op.tensor.nbytes, 0, dt)
            else:
                self._stats.record("recv", 0, op.tensor.nbytes, dt)
        return works

    def close(self) -> None:
        """Release engine resources (optional)."""

    # ------------------------------------------------------------------ engine hooks
    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    @abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    @abstractmethod
    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]: ...

    @abstractmethod
    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int: ...

    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work: ...

    @abstractmethod
    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None: ...

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        """Default: each op posted non-blocking (engines whose ``_isend``/``_irecv`` never block:
        in-memory, MPI's ``Isend``/``Irecv``), receives first."""
        works: list[Work | None] = [None] * len(ops)
        for i, op in enumerate(ops):
            if op.kind == "recv":
                works[i] = self._irecv(op.tensor, op.peer, op.tag)
        for i, op in enumerate(ops):
            if op.kind == "send":
                works[i] = self._isend(op.tensor, op.peer, op.tag)
        return [w for w in works if w is not None]

    def _iall_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self._all_reduce(tensor, op)
        return CompletedWork()

    def _ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        self._reduce_scatter(output, input, op)
        return CompletedWork()

    def _iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self._all_gather(output, input)
        return CompletedWork()
