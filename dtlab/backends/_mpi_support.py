"""Helpers of :mod:`dtlab.backends.mpi`: the lazy mpi4py import, how a tensor is handed to MPI (dtype/op
tables, zero-copy buffer views, host staging) and request handles."""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from dtlab.backends.base import ReduceOp, Work
from dtlab.errors import BackendInitError

_STAGED_REDUCTION = (torch.float16, torch.bfloat16)


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendInitError(
            "MPIBackend needs mpi4py and an MPI library: pip install 'dtlab[mpi]' (or mpi4py mpich)"
        ) from exc
    return MPI


def query_cuda_support(mpi: Any) -> bool:
    """Whether the MPI library reads and writes CUDA memory itself, as the library says at run time.

    ``MPIX_Query_cuda_support()`` is Open MPI's extension, also provided by MPICH >= 4; it is looked
    up in the MPI library that mpi4py loaded. False when the library has no such function (then CUDA
    tensors are staged through host memory, which works with any MPI).
    """
    try:
        query = ctypes.CDLL(mpi.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError, TypeError):
        return False
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


class _Buffers:
    """How this communicator hands tensors to MPI: tables from torch dtypes and ReduceOps to MPI
    datatypes and ops, zero-copy views of a tensor's memory, and the host copies MPI needs for CUDA
    tensors when the library is not CUDA-aware (``cuda_aware``)."""

    def __init__(self, mpi: Any, cuda_aware: bool) -> None:
        self.cuda_aware = cuda_aware
        self.fromaddress = mpi.buffer.fromaddress
        self.types = {
            torch.float32: mpi.FLOAT,
            torch.float64: mpi.DOUBLE,
            torch.int32: mpi.INT32_T,
            torch.int64: mpi.INT64_T,
            torch.uint8: mpi.UINT8_T,
            torch.int8: mpi.INT8_T,
            torch.bool: mpi.C_BOOL,
        }
        self.ops = {
            ReduceOp.SUM: mpi.SUM,
            ReduceOp.AVG: mpi.SUM,
            ReduceOp.MAX: mpi.MAX,
            ReduceOp.MIN: mpi.MIN,
            ReduceOp.PRODUCT: mpi.PROD,
        }
        self.bool_ops = {
            ReduceOp.SUM: mpi.LOR,
            ReduceOp.MAX: mpi.LOR,
            ReduceOp.MIN: mpi.LAND,
            ReduceOp.PRODUCT: mpi.LAND,
        }
        self.byte = mpi.BYTE
        self.in_place = mpi.IN_PLACE

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor MPI reads/writes: ``t`` itself on CPU or CUDA-aware MPI, else a host copy."""
        if t.is_cpu or self.cuda_aware:
            return t
        return t.detach().cpu()

    def raw(self, t: torch.Tensor) -> Any:
        """Zero-copy view of a contiguous tensor's memory: an MPI buffer over its address on CPU
        (far cheaper per call than ``tensor.numpy()``), the CUDA array interface on GPU."""
        if t.is_cpu:
            return self.fromaddress(t.data_ptr(), t.nbytes)
        return t.detach().reshape(-1).view(torch.uint8)

    def bytes(self, t: torch.Tensor) -> list[Any]:
        """``[buffer, MPI.BYTE]``: ``t``'s memory as raw bytes (movement, no arithmetic)."""
        return [self.raw(t), self.byte]

    def counted(self, t: torch.Tensor, counts: list[int], displs: list[int]) -> list[Any]:
        """``[buffer, (byte counts, byte displacements), MPI.BYTE]`` for the v-variants, from counts
        and displacements in elements of ``t``."""
        es = t.element_size()
        return [self.raw(t), ([c * es for c in counts], [d * es for d in displs]), self.byte]

    def typed(self, t: torch.Tensor, op: ReduceOp) -> tuple[list[Any], Any]:
        """``[buffer, MPI datatype]`` and the MPI op for a reduction on ``t``."""
        ops = self.bool_ops if t.dtype is torch.bool else self.ops
        mem = self.fromaddress(t.data_ptr(), t.nbytes) if t.is_cpu else t.detach().reshape(-1)
        return [mem, self.types[t.dtype]], ops[op]

    def reducible(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor MPI reduces: ``t`` itself, or a float32 and/or host copy where MPI needs one."""
        staged = t.dtype in _STAGED_REDUCTION
        on_host = t.is_cpu or self.cuda_aware
        if not staged and on_host:
            return t
        return t.detach().to(
            device=t.device if on_host else "cpu", dtype=torch.float32 if staged else t.dtype
        )


class Requests(Protocol):
    """How a request handle completes (an :class:`~dtlab.backends.mpi.MPIBackend` is one): wait
    within the backend's timeout, and check a receive's size against its buffer (its source rank)."""

    def wait_request(self, request: Any, what: str, status: Any = None) -> None: ...
    def check_received(self, status: Any, buf: torch.Tensor, what: str) -> int: ...


class _MPIWork(Work):
    """A pending MPI request; ``finish`` (copy back, divide for AVG) runs once after completion."""

    def __init__(
        self,
        backend: Requests,
        request: Any,
        what: str,
        keep: tuple[Any, ...] = (),
        finish: Any = None,
        status: Any = None,
    ) -> None:
        self._backend, self._request, self._what = backend, request, what
        self._keep, self._finish, self._status = keep, finish, status
        self._done = False
        self._result: int | None = None

    def wait(self) -> int | None:
        if not self._done:
            self._backend.wait_request(self._request, self._what, self._status)
            if self._finish is not None:
                self._finish()
            if self._status is not None:
                self._result = self._backend.check_received(self._status, self._keep[0], self._what)
            self._done, self._keep = True, ()
        return self._result

    def is_completed(self) -> bool:
        return self._done
