"""In-memory backend: every rank is a thread of one process, all sharing one :class:`InMemoryWorld`.

It is a test instrument, not a mock: ranks really exchange data through shared memory, and the world
turns what real engines turn into hangs into errors. A rank that fails aborts the world; a collective
that not every rank reaches times out naming the missing ranks (at once when a missing rank has
already returned); ranks that call different collectives get a :class:`CollectiveMismatchError`
naming every rank's call.

How a collective runs: every rank deposits its call and its tensors (by reference, no copy) in a slot
of the world; the last rank to arrive (the *leader*) checks that all calls match, does the whole
operation once, in rank order, directly on every rank's tensors (they are all parked inside the
call, so nobody touches them), then wakes the others. That is the minimal data movement of the
operation (``all_reduce``: ``P-1`` in-place adds and ``P-1`` copies), one rendezvous, and results that
are bitwise identical on every rank and independent of thread timing. The meeting and the bounded
wait are ``_inmemory_rendezvous.py``; the operations the leader runs, ``_inmemory_ops.py``.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch

from dtlab.backends._inmemory_ops import (
    lead_all_gather,
    lead_all_gather_v,
    lead_all_reduce,
    lead_all_to_all,
    lead_broadcast,
    lead_reduce,
    lead_reduce_scatter,
    leader_mode,
)
from dtlab.backends._inmemory_rendezvous import Lock, Rendezvous, Slot
from dtlab.backends._run_args import check_timeout, check_world_size
from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work, split_members
from dtlab.errors import CollectiveMismatchError

__all__ = ["InMemoryBackend", "InMemoryWorld"]


class _Message:
    __slots__ = ("src", "tag", "tensor")

    def __init__(self, src: int, tag: int, tensor: torch.Tensor) -> None:
        self.src, self.tag, self.tensor = src, tag, tensor


class InMemoryWorld:
    """Shared state of ``world_size`` in-memory ranks. Build each rank's backend with :meth:`backend`."""

    def __init__(self, world_size: int, timeout: float = 60.0, device: str | torch.device = "cpu") -> None:
        check_world_size("InMemoryWorld", world_size)
        check_timeout("InMemoryWorld", "timeout", timeout)
        self.world_size = world_size
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.mutex = threading.Lock()
        self.slots: dict[tuple[Any, ...], Slot] = {}
        self.mailboxes: dict[tuple[Any, ...], list[_Message]] = {}
        self.mail_waiters: dict[tuple[Any, ...], list[Lock]] = {}
        self.waiting: set[Lock] = set()  # every lock a thread is blocked on right now
        self.failure: tuple[int, BaseException] | None = None
        self.exited: set[int] = set()

    def backend(self, rank: int) -> InMemoryBackend:
        return InMemoryBackend(self, rank)

    def abort(self, rank: int, exc: BaseException) -> None:
        """Record the first failure and release every waiting rank. A mismatch of collectives (raised on
        every rank of the call) gives way to a rank's error that explains it (raised from it)."""
        with self.mutex:
            explains = isinstance(exc.__cause__, CollectiveMismatchError)
            if self.failure is None or (explains and isinstance(self.failure[1], CollectiveMismatchError)):
                self.failure = (rank, exc)
            self._wake_everyone()

    def mark_exited(self, rank: int) -> None:
        """``rank`` returned: ranks waiting for it can never complete, so wake them to find out."""
        with self.mutex:
            self.exited.add(rank)
            self._wake_everyone()

    # the two below run with ``mutex`` held
    def wake(self, waiters: list[Lock]) -> None:
        for lk in waiters:
            if lk in self.waiting:
                self.waiting.discard(lk)
                lk.release()
        waiters.clear()

    def _wake_everyone(self) -> None:
        for lk in self.waiting:
            lk.release()
        self.waiting.clear()


class _RecvWork(Work):
    """A posted receive; its backend completes it (and every receive posted before it) on ``wait()``."""

    def __init__(self, backend: InMemoryBackend, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        self.backend, self.tensor, self.src, self.tag = backend, tensor, src, tag
        self.result: int | None = None
        self.done = False

    def wait(self) -> int | None:
        self.backend.complete_receives(self)
        return self.result

    def is_completed(self) -> bool:
        return self.done


class InMemoryBackend(CommunicationBackend):
    """One rank of an :class:`InMemoryWorld` (or of a group made from it by ``new_group``/``split``)."""

    _checks_calls_itself = True  # the rendezvous compares every rank's call

    def __init__(
        self,
        world: InMemoryWorld,
        rank: int,
        group_key: tuple[Any, ...] = ("world",),
        global_ranks: tuple[int, ...] | None = None,
        parent: InMemoryBackend | None = None,
    ) -> None:
        ranks = global_ranks if global_ranks is not None else tuple(range(world.world_size))
        super().__init__(rank, len(ranks), stats_parent=parent.stats if parent is not None else None)
        self._world = world
        self._key = group_key
        self._global = ranks
        self._seq = 0
        self._pending_recvs: list[_RecvWork] = []
        self._meeting = Rendezvous(world, group_key, ranks, rank)

    @property
    def device(self) -> torch.device:
        return self._world.device

    @property
    def timeout(self) -> float:
        return self._world.timeout

    @property
    def global_rank(self) -> int:
        return self._meeting.global_rank

    def _collective(
        self, call: tuple[Any, ...], payload: Any, leader: Callable[[list[Any]], Any] | None = None
    ) -> Slot:
        """Deposit this rank's call and payload in the group's next collective; the last rank to arrive
        checks the calls match and runs ``leader(payloads)`` once for everyone. Returns the slot."""
        seq = self._seq
        self._seq += 1
        return self._meeting.meet(seq, call, payload, leader)

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        call = ("all_reduce", tensor.shape, tensor.dtype, op)
        self._collective(call, tensor, lambda ts: lead_all_reduce(ts, op))

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        call = ("reduce", tensor.shape, tensor.dtype, op, dst)
        self._collective(call, tensor, lambda ts: lead_reduce(ts, dst, op))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        call = ("broadcast", tensor.shape, tensor.dtype, src)
        self._collective(call, tensor, lambda ts: lead_broadcast(ts, src))

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        call = ("reduce_scatter", output.numel(), output.dtype, op)
        self._collective(call, (output, input), lambda pairs: lead_reduce_scatter(pairs, op))

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        call = ("all_gather", input.numel(), input.dtype)
        self._collective(call, (output, input), lead_all_gather)

    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        slot = self._collective(("all_gather_v", input.dtype), input, lead_all_gather_v)
        outputs, counts = slot.result
        return outputs[self.rank], list(counts)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        self._collective(("all_to_all", inputs[0].dtype), (outputs, inputs), lead_all_to_all)

    def _barrier(self) -> None:
        self._collective(("barrier",), None)

    # ------------------------------------------------------------------ point-to-point
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        w = self._world
        msg = _Message(self.rank, tag, tensor.detach().clone())
        with w.mutex:
            w.mailboxes.setdefault((self._key, dst), []).append(msg)
            waiters = w.mail_waiters.get((self._key, dst))
            if waiters:
                w.wake(waiters)

    def complete_receives(self, until: _RecvWork) -> None:
        """Complete the posted receives in posting order (the matching order) up to ``until``."""
        pending = self._pending_recvs
        while not until.done:
            first = pending[0]
            first.result = self._recv(first.tensor, first.src, first.tag)
            first.done = True
            pending.pop(0)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        w = self._world
        box_key = (self._key, self.rank)
        found: list[_Message] = []

        def ready() -> bool:
            box = w.mailboxes.get(box_key)
            if box:
                for i, m in enumerate(box):
                    if m.tag == tag and (src is None or m.src == src):
                        found.append(box.pop(i))
                        return True
            return False

        peers = [src] if src is not None else [r for r in range(self.world_size) if r != self.rank]
        what = f"recv(src={'any' if src is None else src}, tag={tag})"
        with w.mutex:
            waiters = w.mail_waiters.setdefault(box_key, [])
            self._meeting.wait(waiters, ready, lambda: what, lambda: peers, need_all=False)
        msg = found[0]
        if msg.tensor.dtype != tensor.dtype or msg.tensor.numel() != tensor.numel():
            raise CollectiveMismatchError(
                f"rank {self.rank}: {what} got a message from rank {msg.src} of shape "
                f"{tuple(msg.tensor.shape)} and dtype {msg.tensor.dtype}, but the receive buffer has "
                f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
            )
        with leader_mode([tensor]):
            tensor.view(-1).copy_(msg.tensor.reshape(-1))
        return msg.src

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._send(tensor, dst, tag)
        return CompletedWork()

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        work = _RecvWork(self, tensor, src, tag)
        self._pending_recvs.append(work)
        return work

    # ------------------------------------------------------------------ objects and groups
    def _broadcast_object(self, obj: Any, src: int) -> tuple[Any, int]:
        payload = pickle.dumps(obj) if self.rank == src else None
        slot = self._collective(("broadcast_object", src), payload)
        data: bytes = slot.payloads[src]
        return (obj if self.rank == src else pickle.loads(data)), len(data)

    def _all_gather_object(self, obj: Any) -> tuple[list[Any], list[int]]:
        slot = self._collective(("all_gather_object",), pickle.dumps(obj))
        datas: list[bytes] = slot.payloads
        return [pickle.loads(d) for d in datas], [len(d) for d in datas]

    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None:
        seq = self._seq
        self._collective(("new_group", tuple(ranks)), None)
        return self._subgroup(ranks, (*self._key, seq)) if self.rank in ranks else None

    def _split(self, color: int | None, key: int) -> CommunicationBackend | None:
        seq = self._seq
        pairs: list[tuple[int | None, int]] = self._collective(("split",), (color, key)).payloads
        if color is None:
            return None
        return self._subgroup(split_members(pairs, color), (*self._key, seq, f"color {color}"))

    def _subgroup(self, members: list[int], key: tuple[Any, ...]) -> InMemoryBackend:
        """This rank's backend in the group of ``members`` (ranks of this group, in their new order)."""
        return InMemoryBackend(
            self._world,
            members.index(self.rank),
            group_key=key,
            global_ranks=tuple(self._global[r] for r in members),
            parent=self,
        )
