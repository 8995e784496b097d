"""``MPIBackend``: the interface over mpi4py, for ``mpiexec -n N python train.py`` on any MPI.

Tensors travel as buffers without copies: a contiguous CPU tensor is handed to MPI as a buffer over
its memory (``MPI.buffer.fromaddress``; typed for reductions, raw bytes for movement). What MPI
lacks is bridged explicitly:

* ``float16``/``bfloat16`` have no MPI datatype MPI can add: movement operations (gather, broadcast,
  p2p, all-to-all) send their raw bytes. SUM/AVG ``all_reduce``/``reduce_scatter`` move 16-bit values
  too (an all-to-all of the chunks, a float32 sum on the chunk's owner rounded once, an all-gather:
  :mod:`dtlab.backends._mpi_half`); ``reduce`` and MIN/MAX/PRODUCT convert to float32, reduce, and
  round back once. Either way each element is rounded once (a 16-bit ring rounds after every
  addition) and results are identical on every rank.
* ``bool`` maps to ``MPI.C_BOOL``; SUM/MAX reduce with logical or, MIN/PRODUCT with logical and
  (what ``torch`` does on bool tensors).
* ``ReduceOp.AVG`` is SUM followed by a division by the group size.
* CUDA tensors go to MPI directly (``__cuda_array_interface__``) when the MPI library is CUDA-aware
  (``cuda_aware=None``, the default, asks it: ``MPIX_Query_cuda_support()``; True/False decide);
  otherwise they are staged through host memory, one copy each way.

Bounded waits (``_mpi_wait.py``): by default blocking calls are MPI's blocking calls, watched by a
thread that ends the job after ``watchdog`` seconds (600) in one operation, naming it, and within
seconds where a rank whose script ended left it in a collective (``_mpi_departures.py``). With
``timeout=t`` every operation is started non-blocking and polled; one that has not completed after
``t`` seconds raises :class:`CollectiveTimeoutError` naming it. The communicator is unusable after that
(MPI cannot cancel a collective); end the job with ``MPI.COMM_WORLD.Abort(1)``. A dead peer is the
launcher's business (MPICH's ``mpiexec`` and Open MPI's ``mpirun`` stop the job); an exception no code
catches ends the job too (``_mpi_abort.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dtlab.backends._mpi_abort import AbortOnUncaught
from dtlab.backends._mpi_half import HalfSum
from dtlab.backends._mpi_support import _Buffers, _import_mpi, _MPIWork, query_cuda_support
from dtlab.backends._mpi_vectors import all_gather_v, all_to_all
from dtlab.backends._mpi_wait import DEFAULT_WATCHDOG_S, Waits, Watch, Watchdog, world_ranks
from dtlab.backends._run_args import check_timeout
from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work
from dtlab.backends.stats import CommStats
from dtlab.errors import ArgumentError, CollectiveMismatchError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPIBackend"]

_AVG = ReduceOp.AVG


class MPIBackend(CommunicationBackend):
    """One rank of an MPI communicator (``MPI.COMM_WORLD`` unless ``comm`` is given).

    ``timeout`` (seconds) bounds every operation, polled, raising :class:`CollectiveTimeoutError`;
    ``watchdog`` (seconds; default 600, None: none) ends the job when a blocking call takes longer
    (``shared_watchdog``: the one of the backend this is a group of);
    ``device`` is where this rank's tensors live (``cpu`` or ``cuda:i``); ``cuda_aware`` says the
    MPI library reads CUDA memory itself (None: ask the library; otherwise CUDA tensors are staged
    through host memory).
    """

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        timeout: float | None = None,
        watchdog: float | None = DEFAULT_WATCHDOG_S,
        device: str | torch.device = "cpu",
        cuda_aware: bool | None = None,
        stats_parent: CommStats | None = None,
        shared_watchdog: Watchdog | None = None,
    ) -> None:
        mpi = _import_mpi()
        for name, value in (("timeout", timeout), ("watchdog", watchdog)):
            if value is not None:  # None: unbounded
                check_timeout("MPIBackend", name, value)
        self._mpi = mpi
        self._comm = comm if comm is not None else mpi.COMM_WORLD
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), stats_parent=stats_parent)
        self._timeout = timeout
        self._device = torch.device(device)
        self._cuda_aware = query_cuda_support(mpi) if cuda_aware is None else bool(cuda_aware)
        self._buf = _Buffers(mpi, self._cuda_aware)
        self._tag_ub = int(self._comm.Get_attr(mpi.TAG_UB) or 32767)
        self._fromaddress = mpi.buffer.fromaddress
        self._in_place = mpi.IN_PLACE
        # the direct paths (blocking calls on CPU tensors, as little Python as possible): the dtypes MPI
        # reduces as they are (bool needs logical ops, fp16/bf16 a float32 copy); none with a timeout
        self._direct = (
            {d: t for d, t in self._buf.types.items() if d is not torch.bool} if timeout is None else {}
        )
        self._ops = self._buf.ops
        world = self._comm == mpi.COMM_WORLD and self._world_size > 1  # an uncaught exception ends the job
        self._abort = AbortOnUncaught(mpi) if world else None
        rank = mpi.COMM_WORLD.Get_rank()
        # a world backend's watchdog also hears which ranks ended their script (collective: a Dup)
        own = (
            None
            if shared_watchdog or watchdog is None
            else Watchdog(mpi, watchdog, rank, self._comm if world else None)
        )
        self._owns_watchdog = own is not None
        self._watchdog = own or shared_watchdog
        dog = self._watchdog
        self._watch = dog.slot(world_ranks(mpi, self._comm)) if dog is not None else Watch()
        self._waits = Waits(rank, timeout, self._watch, lambda: self._checked, dog)
        bounded = timeout is not None or self._watchdog is not None  # half sums wait through wait_request
        self._half = HalfSum(self._comm, self._buf, self.wait_request, polled=bounded)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def comm(self) -> MPI.Comm:
        """The underlying mpi4py communicator."""
        return self._comm

    @property
    def timeout(self) -> float | None:
        return self._timeout

    @property
    def watchdog(self) -> float | None:
        """Seconds after which a blocking call ends the job (None: no watchdog)."""
        return None if self._watchdog is None else self._watchdog.seconds

    @property
    def cuda_aware(self) -> bool:
        """True when CUDA tensors go to MPI directly, False when they are staged through host memory."""
        return self._cuda_aware

    def wait_request(self, request: Any, what: str, status: Any = None) -> None:
        self._waits.wait(request, what, status)

    def _run(self, blocking: Any, nonblocking: Any, args: tuple[Any, ...], what: str, **kw: Any) -> None:
        self._waits.run(blocking, nonblocking, args, what, **kw)

    # ------------------------------------------------------------------ reductions
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        mtype = self._direct.get(tensor.dtype)
        if mtype is not None and tensor.is_cpu:  # the common case
            buf = [self._fromaddress(tensor.data_ptr(), tensor.nbytes), mtype]
            self._watch.call("all_reduce", self._comm.Allreduce, self._in_place, buf, self._ops[op])
            if op is _AVG:
                tensor.div_(self._world_size)
            return
        if self._half.handles(tensor.dtype, op):  # 16-bit values on the wire
            self._half.all_reduce(tensor, op, blocking=True)
            return
        work = self._buf.reducible(tensor)
        spec, mop = self._buf.typed(work, op)
        c = self._comm
        self._run(c.Allreduce, c.Iallreduce, (self._mpi.IN_PLACE, spec, mop), "all_reduce")
        if op is ReduceOp.AVG:
            work.div_(self.world_size)
        if work is not tensor:
            tensor.copy_(work)

    def _iall_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        if self._half.handles(tensor.dtype, op):
            return self._half.all_reduce(tensor, op, blocking=False)
        work = self._buf.reducible(tensor)
        spec, mop = self._buf.typed(work, op)
        p = self.world_size

        def finish() -> None:
            if op is ReduceOp.AVG:
                work.div_(p)
            if work is not tensor:
                tensor.copy_(work)

        req = self._comm.Iallreduce(self._mpi.IN_PLACE, spec, mop)
        return _MPIWork(self, req, "all_reduce", (work,), finish)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        c, mpi = self._comm, self._mpi
        work = self._buf.reducible(tensor)
        spec, mop = self._buf.typed(work, op)
        if self.rank != dst:  # a non-root's tensor is left as it was
            self._run(c.Reduce, c.Ireduce, (spec, None, mop), "reduce", root=dst)
            return
        self._run(c.Reduce, c.Ireduce, (mpi.IN_PLACE, spec, mop), "reduce", root=dst)
        if op is ReduceOp.AVG:
            work.div_(self.world_size)
        if work is not tensor:
            tensor.copy_(work)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        mtype = self._direct.get(input.dtype)
        if mtype is not None and input.is_cpu and output.is_cpu:
            fa, o, i, on, n = (
                self._fromaddress,
                output.data_ptr(),
                input.data_ptr(),
                output.nbytes,
                input.nbytes,
            )
            if o + on <= i or i + n <= o:  # no overlap (MPI forbids aliasing send and receive buffers)
                send, recv = [fa(i, n), mtype], [fa(o, on), mtype]
                self._watch.call("reduce_scatter", self._comm.Reduce_scatter_block, send, recv, self._ops[op])
                if op is _AVG:
                    output.div_(self._world_size)
                return
        self._start_reduce_scatter(output, input, op, blocking=True)

    def _ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        return self._start_reduce_scatter(output, input, op, blocking=False)

    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, blocking: bool
    ) -> Work:
        if self._half.handles(input.dtype, op):
            return self._half.reduce_scatter(output, input, op, blocking)
        src = self._buf.reducible(input)
        aliased = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        out = self._buf.reducible(output)
        if out is output and aliased:  # MPI forbids overlapping send and receive buffers
            out = torch.empty_like(output)
        send, mop = self._buf.typed(src, op)
        recv, _ = self._buf.typed(out, op)
        p = self.world_size

        def finish() -> None:
            if op is ReduceOp.AVG:
                out.div_(p)
            if out is not output:
                output.copy_(out)

        c = self._comm
        if blocking and self._timeout is None:
            self._run(c.Reduce_scatter_block, None, (send, recv, mop), "reduce_scatter")
            finish()
            return CompletedWork()
        work = _MPIWork(self, c.Ireduce_scatter_block(send, recv, mop), "reduce_scatter", (src, out), finish)
        if blocking:
            work.wait()
        return work

    # ------------------------------------------------------------------ movement
    def _gather_buffers(self, output: torch.Tensor, input: torch.Tensor) -> tuple[Any, torch.Tensor, Any]:
        """Send spec (``IN_PLACE`` when input is this rank's chunk of output), receive tensor, finish."""
        out = self._buf.host(output)
        n = input.numel() * input.element_size()
        if out is output and output.data_ptr() + self.rank * n == input.data_ptr():
            return self._mpi.IN_PLACE, out, None
        inp = self._buf.host(input)
        if inp is input and input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
            inp = input.clone()  # input overlaps output elsewhere: MPI forbids aliasing
        finish = None if out is output else (lambda: output.copy_(out))
        return self._buf.bytes(inp), out, finish

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._timeout is None and output.is_cpu and input.is_cpu:
            fa, o, i, on, n = (
                self._fromaddress,
                output.data_ptr(),
                input.data_ptr(),
                output.nbytes,
                input.nbytes,
            )
            if o + on <= i or i + n <= o or i == o + self.rank * n:
                send = self._in_place if i == o + self.rank * n else [fa(i, n), self._buf.byte]
                self._watch.call("all_gather", self._comm.Allgather, send, [fa(o, on), self._buf.byte])
                return
        send, out, finish = self._gather_buffers(output, input)
        c = self._comm
        self._run(c.Allgather, c.Iallgather, (send, self._buf.bytes(out)), "all_gather")
        if finish is not None:
            finish()

    def _iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        send, out, finish = self._gather_buffers(output, input)
        req = self._comm.Iallgather(send, self._buf.bytes(out))
        return _MPIWork(self, req, "all_gather", (send, out), finish)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        buf = self._buf.host(tensor)
        c = self._comm
        self._run(c.Bcast, c.Ibcast, (self._buf.bytes(buf),), "broadcast", root=src)
        if buf is not tensor:
            tensor.copy_(buf)

    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        return all_gather_v(self._comm, self._buf, self._run, input)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        all_to_all(self._comm, self._buf, self._run, outputs, inputs)

    def _barrier(self) -> None:
        c = self._comm
        self._run(c.Barrier, c.Ibarrier, (), "barrier")

    # ------------------------------------------------------------------ point-to-point
    def _check_tag(self, tag: int, what: str) -> None:
        if not 0 <= tag <= self._tag_ub:
            raise ArgumentError(f"{what}: tag={tag} is outside MPI's range [0, {self._tag_ub}]")

    def check_received(self, status: Any, buf: torch.Tensor, what: str) -> int:
        got = status.Get_count(self._buf.byte)
        want = buf.numel() * buf.element_size()
        source = int(status.Get_source())
        if got != want:
            raise CollectiveMismatchError(
                f"rank {self.rank}: {what} got {got} bytes from rank {source} but the receive buffer "
                f"holds {want} bytes ({tuple(buf.shape)} of {buf.dtype})"
            )
        return source

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._check_tag(tag, "send")
        c = self._comm
        self._run(
            c.Send,
            c.Isend,
            (self._buf.bytes(self._buf.host(tensor)), dst, tag),
            f"send(dst={dst}, tag={tag})",
        )

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        return self._irecv(tensor, src, tag).wait() or 0

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._check_tag(tag, "isend")
        buf = self._buf.host(tensor)
        req = self._comm.Isend(self._buf.bytes(buf), dst, tag)
        return _MPIWork(self, req, f"isend(dst={dst}, tag={tag})", (buf,))

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        self._check_tag(tag, "recv")
        mpi = self._mpi
        buf = self._buf.host(tensor)
        status = mpi.Status()
        source = mpi.ANY_SOURCE if src is None else src
        what = f"recv(src={'any' if src is None else src}, tag={tag})"
        req = self._comm.Irecv(self._buf.bytes(buf), source, tag)
        finish = None if buf is tensor else (lambda: tensor.copy_(buf))
        return _MPIWork(self, req, what, (buf,), finish, status)

    # ------------------------------------------------------------------ groups
    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None:
        member = self.rank in ranks
        key = ranks.index(self.rank) if member else 0
        sub = self._waits.blocking(self._comm.Split, (0 if member else self._mpi.UNDEFINED, key), "new_group")
        return self._member(sub) if member else None

    def _split(self, color: int | None, key: int) -> CommunicationBackend | None:
        sub = self._waits.blocking(
            self._comm.Split, (self._mpi.UNDEFINED if color is None else color, key), "split"
        )
        return None if color is None else self._member(sub)

    def _member(self, sub: MPI.Comm) -> MPIBackend:
        """A backend over a sub-communicator of this one, with the same settings, counted in ours."""
        t, dev, aware, dog = self._timeout, self._device, self._cuda_aware, self._watchdog
        return MPIBackend(
            sub,
            timeout=t,
            watchdog=None,
            device=dev,
            cuda_aware=aware,
            stats_parent=self.stats,
            shared_watchdog=dog,
        )

    def close(self) -> None:
        """Free this backend's communicators (``COMM_WORLD`` itself is left to MPI's finalization)."""
        self._half.close()
        if self._abort is not None:
            self._abort.remove()
        if self._watchdog is not None:
            self._watchdog.drop(self._watch)
            if self._owns_watchdog:
                self._watchdog.stop()
        if self._comm != self._mpi.COMM_WORLD and self._comm != self._mpi.COMM_NULL:
            self._comm.Free()
