"""In-memory backend: every rank is a thread of one process, all sharing one :class:`InMemoryWorld`.

It is a test instrument, not a mock: ranks really exchange data through shared memory, and the world
turns what real engines turn into hangs into errors. A rank that fails aborts the world; a collective
that not every rank reaches times out naming the missing ranks (at once when a missing rank has
already returned); ranks that call different collectives get a :class:`CollectiveMismatchError`
naming every rank's call. Reductions run in rank order, so results are bitwise identical on every rank
and independent of thread timing.

Large tensors are reduced in place of copies: every rank deposits a reference, reduces its own
``1/P`` chunk of the result, and a second rendezvous keeps inputs alive until every rank has read them.
Small tensors (<= 64 KiB) are cloned and reduced by each rank with a single rendezvous.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, WorldAbortedError

__all__ = ["InMemoryBackend", "InMemoryWorld"]

SMALL_BYTES = 64 * 1024


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    """``out = parts[0] (op) parts[1] (op) ...`` in rank order; ``out`` may not alias a part."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if len(parts) == 1:
            out.copy_(parts[0])
        else:
            torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        if op is ReduceOp.AVG:
            out.div_(len(parts))
        return
    fn = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PRODUCT: torch.mul}[op]
    out.copy_(parts[0])
    for p in parts[1:]:
        fn(out, p, out=out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Slot:
    size: int
    calls: list[str | None] = field(default_factory=list)
    payloads: list[Any] = field(default_factory=list)
    arrived: int = 0
    left: int = 0
    done: int = 0
    shared: Any = None

    def __post_init__(self) -> None:
        self.calls = [None] * self.size
        self.payloads = [None] * self.size


@dataclass
class _Message:
    src: int
    tag: int
    tensor: torch.Tensor


class InMemoryWorld:
    """Shared state of ``world_size`` in-memory ranks. Build each rank's backend with :meth:`backend`."""

    def __init__(self, world_size: int, timeout: float = 60.0, device: str | torch.device = "cpu") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.cond = threading.Condition()
        self.slots: dict[tuple[Any, ...], _Slot] = {}
        self.mailboxes: dict[tuple[Any, ...], list[_Message]] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.exited: set[int] = set()

    def backend(self, rank: int) -> InMemoryBackend:
        return InMemoryBackend(self, rank)

    def abort(self, rank: int, exc: BaseException) -> None:
        """Record the first failure and release every waiting rank."""
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def mark_exited(self, rank: int) -> None:
        with self.cond:
            self.exited.add(rank)
            self.cond.notify_all()


class _RecvWork(Work):
    def __init__(self, backend: InMemoryBackend, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        self._backend, self._tensor, self._src, self._tag = backend, tensor, src, tag
        self._result: int | None = None
        self._done = False

    def wait(self) -> int | None:
        pending = self._backend._pending_recvs
        while not self._done:  # complete earlier posted receives first: posting order is matching order
            first = pending[0]
            first._result = self._backend._recv(first._tensor, first._src, first._tag)
            first._done = True
            pending.pop(0)
        return self._result

    def is_completed(self) -> bool:
        return self._done


class InMemoryBackend(CommunicationBackend):
    """One rank of an :class:`InMemoryWorld` (or of a group made from it by ``new_group``)."""

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

    @property
    def device(self) -> torch.device:
        return self._world.device

    @property
    def timeout(self) -> float:
        return self._world.timeout

    @property
    def global_rank(self) -> int:
        return self._global[self.rank]

    # ------------------------------------------------------------------ waiting
    def _wait(self, ready: Callable[[], bool], what: str, missing: Callable[[], list[int]]) -> None:
        """Wait (holding ``world.cond``) until ``ready()``; raise on abort, exit of a peer, timeout."""
        w = self._world
        deadline = time.monotonic() + w.timeout
        while not ready():
            if w.failure is not None:
                rank, exc = w.failure
                raise WorldAbortedError(
                    f"rank {self.global_rank}: {what} aborted because rank {rank} failed: "
                    f"{type(exc).__name__}: {exc}"
                )
            gone = [r for r in missing() if self._global[r] in w.exited]
            if gone:
                raise CollectiveTimeoutError(
                    f"rank {self.global_rank}: {what} can never complete: rank(s) {gone} of this "
                    f"group already returned without reaching it",
                    tuple(gone),
                    what,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                lacking = missing()
                raise CollectiveTimeoutError(
                    f"rank {self.global_rank}: {what} timed out after {w.timeout:g}s waiting for "
                    f"rank(s) {lacking} of this group (world ranks "
                    f"{[self._global[r] for r in lacking]}); did every rank call it?",
                    tuple(lacking),
                    what,
                )
            w.cond.wait(min(remaining, 0.5))

    def _rendezvous(self, call: str, payload: Any) -> tuple[_Slot, int]:
        """Deposit this rank's call and payload; return the slot once every rank has arrived."""
        seq = self._seq
        self._seq += 1
        key = (self._key, seq)
        p, me, w = self.world_size, self.rank, self._world
        with w.cond:
            slot = w.slots.get(key)
            if slot is None:
                slot = w.slots[key] = _Slot(p)
            slot.calls[me] = call
            slot.payloads[me] = payload
            slot.arrived += 1
            if slot.arrived == p:
                w.cond.notify_all()
            else:
                self._wait(
                    lambda: slot.arrived == p,
                    f"{call} (collective #{seq})",
                    lambda: [r for r in range(p) if slot.calls[r] is None],
                )
            slot.left += 1
            if slot.left == p:
                del w.slots[key]
        if len(set(slot.calls)) > 1:
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(slot.calls))
            raise CollectiveMismatchError(
                f"ranks called different collectives at collective #{seq} of group "
                f"{list(self._global)}: {listing}"
            )
        return slot, seq

    def _finish(self, slot: _Slot, call: str, seq: int) -> None:
        """Second rendezvous: no rank leaves (and reuses its inputs) until every rank has read them."""
        p, w = self.world_size, self._world
        with w.cond:
            slot.done += 1
            if slot.done == p:
                w.cond.notify_all()
            else:
                self._wait(lambda: slot.done == p, f"{call} (collective #{seq}, completion)", lambda: [])

    def _share(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Small tensors are cloned (one rendezvous); large ones shared by reference (two)."""
        if _nbytes(t) <= SMALL_BYTES:
            return t.clone(), False
        return t, True

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        payload, by_ref = self._share(tensor)
        call = f"all_reduce(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, op={op.name})"
        slot, seq = self._rendezvous(call, payload)
        parts = [t.reshape(-1) for t in slot.payloads]
        if not by_ref:
            _reduce_into(tensor.view(-1), parts, op)
            return
        with self._world.cond:
            if slot.shared is None:
                slot.shared = torch.empty_like(parts[0])
        result: torch.Tensor = slot.shared
        n, p, me = result.numel(), self.world_size, self.rank
        lo, hi = n * me // p, n * (me + 1) // p
        _reduce_into(result[lo:hi], [t[lo:hi] for t in parts], op)
        self._finish(slot, "all_reduce", seq)
        tensor.view(-1).copy_(result)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        payload, by_ref = self._share(tensor)
        call = f"reduce(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, op={op.name}, dst={dst})"
        slot, seq = self._rendezvous(call, payload)
        if self.rank == dst:
            out = torch.empty_like(tensor).view(-1)
            _reduce_into(out, [t.reshape(-1) for t in slot.payloads], op)
            tensor.view(-1).copy_(out)
        if by_ref:
            self._finish(slot, "reduce", seq)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        payload, by_ref = self._share(tensor) if self.rank == src else (None, _nbytes(tensor) > SMALL_BYTES)
        call = f"broadcast(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, src={src})"
        slot, seq = self._rendezvous(call, payload)
        if self.rank != src:
            tensor.copy_(slot.payloads[src])
        if by_ref:
            self._finish(slot, "broadcast", seq)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        payload, by_ref = self._share(input)
        call = f"reduce_scatter(output_numel={output.numel()}, dtype={output.dtype}, op={op.name})"
        slot, seq = self._rendezvous(call, payload)
        n, me = output.numel(), self.rank
        out = output.view(-1)
        parts = [t.reshape(-1)[me * n : (me + 1) * n] for t in slot.payloads]
        if by_ref:
            tmp = torch.empty_like(out)  # output may alias this rank's input chunk
            _reduce_into(tmp, parts, op)
            self._finish(slot, "reduce_scatter", seq)
            out.copy_(tmp)
        else:
            _reduce_into(out, parts, op)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        payload, by_ref = self._share(input)
        call = f"all_gather(input_numel={input.numel()}, dtype={input.dtype})"
        slot, seq = self._rendezvous(call, payload)
        n = input.numel()
        out = output.view(-1)
        if by_ref:
            own = input.reshape(-1).clone()  # output may alias input
            for r, t in enumerate(slot.payloads):
                if r != self.rank:
                    out[r * n : (r + 1) * n].copy_(t.reshape(-1))
            self._finish(slot, "all_gather", seq)
            out[self.rank * n : (self.rank + 1) * n].copy_(own)
        else:
            torch.cat([t.reshape(-1) for t in slot.payloads], out=out)

    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        slot, _ = self._rendezvous(f"all_gather_v(dtype={input.dtype})", input.clone())
        parts = slot.payloads
        return torch.cat(parts), [int(t.numel()) for t in parts]

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        slot, seq = self._rendezvous(f"all_to_all(dtype={inputs[0].dtype})", inputs)
        me = self.rank
        errors = [
            f"rank {j} sends {slot.payloads[j][me].numel()} elements but outputs[{j}] has "
            f"{outputs[j].numel()}"
            for j in range(self.world_size)
            if slot.payloads[j][me].numel() != outputs[j].numel()
        ]
        if errors:
            raise CollectiveMismatchError(f"all_to_all on rank {me}: " + "; ".join(errors))
        received = [slot.payloads[j][me].reshape(outputs[j].shape).clone() for j in range(self.world_size)]
        self._finish(slot, "all_to_all", seq)
        for out, t in zip(outputs, received, strict=True):
            out.copy_(t)

    def _barrier(self) -> None:
        self._rendezvous("barrier()", None)

    # ------------------------------------------------------------------ point-to-point
    def _mailbox(self, dst: int) -> list[_Message]:
        return self._world.mailboxes.setdefault((self._key, dst), [])

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        w = self._world
        with w.cond:
            self._mailbox(dst).append(_Message(self.rank, tag, tensor.detach().clone()))
            w.cond.notify_all()

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        w = self._world
        box = self._mailbox(self.rank)
        found: list[int] = []

        def ready() -> bool:
            for i, m in enumerate(box):
                if m.tag == tag and (src is None or m.src == src):
                    found.append(i)
                    return True
            return False

        peers = [src] if src is not None else [r for r in range(self.world_size) if r != self.rank]
        what = f"recv(src={'any' if src is None else src}, tag={tag})"
        with w.cond:
            self._wait(ready, what, lambda: peers if all(self._global[r] in w.exited for r in peers) else [])
            msg = box.pop(found[0])
        if msg.tensor.dtype != tensor.dtype or msg.tensor.numel() != tensor.numel():
            raise CollectiveMismatchError(
                f"rank {self.rank}: {what} got a message from rank {msg.src} of shape "
                f"{tuple(msg.tensor.shape)} and dtype {msg.tensor.dtype}, but the receive buffer has "
                f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
            )
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
        slot, _ = self._rendezvous(f"broadcast_object(src={src})", payload)
        data: bytes = slot.payloads[src]
        return (obj if self.rank == src else pickle.loads(data)), len(data)

    def _all_gather_object(self, obj: Any) -> tuple[list[Any], list[int]]:
        slot, _ = self._rendezvous("all_gather_object()", pickle.dumps(obj))
        datas: list[bytes] = slot.payloads
        return [pickle.loads(d) for d in datas], [len(d) for d in datas]

    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None:
        _, seq = self._rendezvous(f"new_group(ranks={ranks})", None)
        if self.rank not in ranks:
            return None
        return InMemoryBackend(
            self._world,
            ranks.index(self.rank),
            group_key=(*self._key, seq),
            global_ranks=tuple(self._global[r] for r in ranks),
            parent=self,
        )
