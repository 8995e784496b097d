"""Helpers of :mod:`dtlab.backends.mpi`: the lazy mpi4py import, dtype/op tables and request handles."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from dtlab.backends.base import ReduceOp, Work
from dtlab.errors import BackendInitError

if TYPE_CHECKING:
    from dtlab.backends.mpi import MPIBackend

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
    """Per-communicator tables from torch dtypes and ReduceOps to MPI datatypes and ops."""

    def __init__(self, mpi: Any) -> None:
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


class _MPIWork(Work):
    """A pending MPI request; ``finish`` (copy back, divide for AVG) runs once after completion."""

    def __init__(
        self,
        backend: MPIBackend,
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
