"""float16/bfloat16 SUM and AVG for :class:`~dtlab.backends.mpi.MPIBackend` that move 16-bit values.

MPI has no bfloat16 datatype (and MPICH's float16 one is an extension), so MPI cannot add these
dtypes itself. Converting to float32 and letting MPI reduce would put twice the bytes on the wire, so
here MPI only moves the raw 16-bit values and the arithmetic is done locally:

1. reduce-scatter: the flat tensor is cut into ``P`` consecutive chunks of ``q = n // P`` elements,
   the last one also taking the ``r = n % P`` left over; an ``Alltoallv`` of raw bytes sends chunk
   ``j`` to rank ``j``;
2. each rank adds the ``P`` copies of its chunk in float32, in rank order ``0 .. P-1``, divides by
   ``P`` for AVG, and rounds once to the tensor's dtype (round to nearest even);
3. all-reduce only: an ``Allgather`` of the ``q``-element chunks in place, and when ``r > 0`` a
   ``Bcast`` of the last rank's ``r`` extra elements (MPICH's ``Allgatherv`` of unequal chunks
   measured 10-50x slower than its ``Allgather`` on shared memory).

Each rank sends ``(n - c) + (P-1) c`` elements of 2 bytes for an all-reduce (``c``: its chunk),
``2(P-1)/P * 2n`` bytes on average over the ranks, half of the float32 route; a reduce-scatter sends
``(P-1)/P`` of its input. Every element is rounded once, and each chunk by one rank only, so the
result is identical on every rank. Gloo adds in the 16-bit dtype along its ring instead, rounding
after every addition (``P-1`` roundings, in an order that depends on the element's position).

The all-gathers run on a duplicate of the communicator made at the first all-reduce, and a
non-blocking all-reduce reaches its all-gather only when it (or a later one) is waited for; waiting
completes the pending all-reduces in the order they were started, so the all-gathers start in the
same order on every rank whatever order the caller waits in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from dtlab.backends.types import CompletedWork, ReduceOp, Work

__all__ = ["HALF_DTYPES", "HalfSum", "sum_rows"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_SUMS = (ReduceOp.SUM, ReduceOp.AVG)
#: elements added at a time on CPU: the two float32 block buffers (2 MiB) stay in cache
_BLOCK = 1 << 18


def sum_rows(rows: list[torch.Tensor], out: torch.Tensor, divide: int = 1) -> None:
    """``out = round(((rows[0] + rows[1]) + ...) / divide)``: the 1-d ``rows`` added in float32 in
    list order, rounded once to ``out``'s dtype. ``out`` may be one of the rows (each block is read
    before it is written)."""
    m = out.numel()
    if m == 0:
        return
    block = _BLOCK if out.is_cpu else m
    acc = torch.empty(min(block, m), dtype=torch.float32, device=out.device)
    tmp = torch.empty_like(acc)
    for i in range(0, m, block):
        k = min(block, m - i)
        a, t = acc[:k], tmp[:k]
        a.copy_(rows[0][i : i + k])
        for row in rows[1:]:
            t.copy_(row[i : i + k])  # widen first: a mixed-dtype add is several times slower
            a.add_(t)
        if divide != 1:
            a.div_(divide)
        out[i : i + k].copy_(a)


def _chunks(n: int, p: int) -> tuple[list[int], list[int]]:
    """Counts and displacements of ``p`` consecutive chunks of ``n // p`` elements, the last one
    also taking the ``n % p`` left over."""
    q, r = divmod(n, p)
    return [q] * (p - 1) + [q + r], [j * q for j in range(p)]


def _ready(t: torch.Tensor) -> None:
    """Wait for the kernels that write ``t`` before MPI reads it (CUDA-aware MPI)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class _Steps(Work):
    """The rest of an operation (wait for its exchange, add, gather, copy back), run once on
    ``wait()``; through ``owner``'s queue when other all-reduces must complete first."""

    def __init__(self, finish: Callable[[], None], owner: HalfSum | None = None) -> None:
        self._finish, self._owner, self._done = finish, owner, False

    def wait(self) -> int | None:
        if not self._done:
            if self._owner is not None:
                self._owner.complete_through(self)
            else:
                self.run()
        return None

    def run(self) -> None:
        self._finish()
        self._done = True

    def is_completed(self) -> bool:
        return self._done


class HalfSum:
    """SUM/AVG of float16/bfloat16 tensors over ``comm`` that move 16-bit values (module doc).

    ``views`` hands tensors to MPI (``_mpi_support._Buffers``); ``wait(request, what)`` completes a
    request (bounded by the backend's timeout); ``polled``: every operation starts non-blocking and is
    completed through ``wait`` (a backend with a timeout).
    """

    def __init__(self, comm: Any, views: Any, wait: Callable[[Any, str], None], polled: bool) -> None:
        self._comm, self._views, self._wait, self._polled = comm, views, wait, polled
        self._gather_comm: Any = None
        self._pending: deque[_Steps] = deque()
        self._scratch = torch.empty(0, dtype=torch.int16)  # blocking calls' receive buffer, reused

    @staticmethod
    def handles(dtype: torch.dtype, op: ReduceOp) -> bool:
        """True for the reductions done here: SUM and AVG of float16/bfloat16."""
        return dtype in HALF_DTYPES and op in _SUMS

    def _receive_buffer(self, numel: int, like: torch.Tensor, blocking: bool) -> torch.Tensor:
        if not blocking or not like.is_cpu:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.int16)
        return self._scratch[:numel].view(like.dtype)

    def _exchange(
        self, send: torch.Tensor, counts: list[int], displs: list[int], chunk: int, blocking: bool
    ) -> tuple[list[torch.Tensor], Any]:
        """Start the all-to-all that hands rank ``j`` the ``j``-th part of ``send`` (``counts`` and
        ``displs`` in elements; nothing travels to this rank itself). Returns the ``P`` rows to add
        (this rank's own part read in place) and the request (None: completed already)."""
        p = len(counts)
        me = self._comm.Get_rank()
        recv = self._receive_buffer((p - 1) * chunk, send, blocking)
        rdispls = [(j - (j > me)) * chunk for j in range(p)]
        rcounts = [0 if j == me else chunk for j in range(p)]
        scounts = [0 if j == me else c for j, c in enumerate(counts)]
        _ready(send)
        args = (self._views.counted(send, scounts, displs), self._views.counted(recv, rcounts, rdispls))
        request = None
        if blocking and not self._polled:
            self._comm.Alltoallv(*args)
        else:
            request = self._comm.Ialltoallv(*args)
        own = send[displs[me] : displs[me] + chunk]
        rows = [own if j == me else recv[rdispls[j] : rdispls[j] + chunk] for j in range(p)]
        return rows, request

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, blocking: bool) -> Work:
        """SUM/AVG ``tensor`` in place on every rank; ``blocking``: complete before returning."""
        p, n = self._comm.Get_size(), tensor.numel()
        if p == 1 or n == 0:  # nothing to add (AVG divides by 1)
            return CompletedWork()
        if self._gather_comm is None:  # collective: every rank reaches its first all-reduce here
            self._gather_comm = self._duplicate()
        host = self._views.host(tensor)
        flat = host.view(-1)
        counts, displs = _chunks(n, p)
        me = self._comm.Get_rank()
        rows, request = self._exchange(flat, counts, displs, counts[me], blocking)
        gather_comm, views = self._gather_comm, self._views

        def finish() -> None:
            if request is not None:
                self._wait(request, "all_reduce (reduce-scatter part)")
            sum_rows(rows, rows[me], p if op is ReduceOp.AVG else 1)
            _ready(flat)
            q = counts[0]
            if q > 0:
                self._call(gather_comm, "Allgather", (views.in_place, views.bytes(flat[: p * q])), blocking)
            if counts[-1] > q:  # the left-over elements, reduced by the last rank
                self._call(gather_comm, "Bcast", (views.bytes(flat[p * q :]), p - 1), blocking)
            if host is not tensor:
                tensor.copy_(host)

        work = _Steps(finish, self)
        self._pending.append(work)
        if blocking:
            work.wait()
        return work

    def _call(self, comm: Any, name: str, args: tuple[Any, ...], blocking: bool) -> None:
        """``comm.<name>(*args)``, or its non-blocking form completed through ``wait``."""
        if blocking and not self._polled:
            getattr(comm, name)(*args)
        else:
            self._wait(getattr(comm, "I" + name.lower())(*args), f"all_reduce ({name} part)")

    def _duplicate(self) -> Any:
        if not self._polled:
            return self._comm.Dup()
        comm, request = self._comm.Idup()
        self._wait(request, "all_reduce (duplicating the communicator)")
        return comm

    def complete_through(self, work: _Steps) -> None:
        """Complete the pending all-reduces in the order they started, up to and including ``work``."""
        while self._pending:
            first = self._pending.popleft()
            first.run()
            if first is work:
                return

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, blocking: bool) -> Work:
        """``output`` = SUM/AVG of chunk ``rank`` of every rank's flat ``input``."""
        p, m = self._comm.Get_size(), output.numel()
        if p == 1 or m == 0:  # nothing to add (AVG divides by 1)
            if output.data_ptr() != input.data_ptr():
                output.view(-1).copy_(input.view(-1))
            return CompletedWork()
        me = self._comm.Get_rank()
        src, dst = self._views.host(input).view(-1), self._views.host(output).view(-1)
        own = src[me * m : (me + 1) * m]
        if dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and (
            dst.data_ptr() != own.data_ptr()
        ):  # output overlaps input elsewhere than this rank's chunk: add into a separate buffer
            dst = torch.empty_like(dst)
        rows, request = self._exchange(src, [m] * p, [j * m for j in range(p)], m, blocking)

        def finish() -> None:
            if request is not None:
                self._wait(request, "reduce_scatter")
            sum_rows(rows, dst, p if op is ReduceOp.AVG else 1)
            if dst.data_ptr() != output.data_ptr() or dst.device != output.device:
                output.view(-1).copy_(dst)

        work = _Steps(finish)
        if blocking:
            work.wait()
        return work

    def close(self) -> None:
        """Free the all-gathers' communicator (collective, like the backend's ``close``)."""
        if self._gather_comm is not None:
            self._gather_comm.Free()
            self._gather_comm = None
