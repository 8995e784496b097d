"""The vocabulary of the interface: :class:`ReduceOp`, the handles of non-blocking operations
(:class:`Work`), and the tensor dtypes every backend accepts. Re-exported by :mod:`dtlab.backends.base`."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from dtlab.errors import ArgumentError

__all__ = ["SUPPORTED_DTYPES", "CompletedWork", "P2POp", "ReduceOp", "Work"]

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.bool,
)


class ReduceOp(enum.Enum):
    """Reduction applied by ``all_reduce``, ``reduce`` and ``reduce_scatter``."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    # members are singletons compared by identity; Enum's own hash runs Python code, and engines look
    # an op up in a table on every call
    __hash__ = object.__hash__


class Work(ABC):
    """Handle of a non-blocking operation; ``wait()`` completes it (for ``irecv``: returns the source)."""

    #: ``is_completed()`` tells, without blocking, whether the operation has finished (a caller may
    #: poll it to bound a wait); False where it only turns True after ``wait()``
    polls: ClassVar[bool] = False

    @abstractmethod
    def wait(self) -> int | None: ...

    def is_completed(self) -> bool:
        return False


class CompletedWork(Work):
    """A handle for an operation that already finished."""

    def __init__(self, result: int | None = None) -> None:
        self._result = result

    polls: ClassVar[bool] = True

    def wait(self) -> int | None:
        return self._result

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class P2POp:
    """One point-to-point operation of a batch (:meth:`CommunicationBackend.batch_isend_irecv`):
    ``kind`` ``"send"`` (``tensor`` to rank ``peer``) or ``"recv"`` (into ``tensor`` from ``peer``),
    with ``tag``. ``P2POp.send(t, 1)`` and ``P2POp.recv(t, 0)`` build them."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    def __post_init__(self) -> None:
        kind: object = self.kind
        if kind not in ("send", "recv"):
            raise ArgumentError(
                f"P2POp: kind must be 'send' or 'recv', got {kind!r}; or build it with P2POp.send(t, dst) / "
                "P2POp.recv(t, src)"
            )

    @classmethod
    def send(cls, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2POp:
        return cls("send", tensor, dst, tag)

    @classmethod
    def recv(cls, tensor: torch.Tensor, src: int, tag: int = 0) -> P2POp:
        return cls("recv", tensor, src, tag)
