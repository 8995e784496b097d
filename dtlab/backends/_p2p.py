"""Point-to-point operations of :class:`~dtlab.backends.base.CommunicationBackend` (a part of it):
``send``/``recv``, their non-blocking forms and ``batch_isend_irecv``, checked and counted here
once; the engines move the messages (``_send``, ``_recv``, ``_isend``, ``_irecv``,
``_batch_isend_irecv``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from time import perf_counter

import torch

from dtlab.backends._engine import Engine
from dtlab.backends.types import P2POp, Work
from dtlab.errors import ArgumentError

__all__ = ["PointToPoint"]


class PointToPoint(Engine):
    """Messages between two ranks: those between a pair with one tag arrive in order."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst``; messages between a pair with one tag arrive in order."""
        self._check_tensor(tensor, "send")
        dst = self._check_peer(dst, "send", "dst")
        t0 = perf_counter()
        self._send(tensor, dst, tag)
        self._stats.record("send", tensor.nbytes, 0, perf_counter() - t0)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (``None``: any rank); returns the source rank."""
        self._check_tensor(tensor, "recv")
        if src is not None:
            src = self._check_peer(src, "recv", "src")
        t0 = perf_counter()
        source = self._recv(tensor, src, tag)
        self._stats.record("recv", 0, tensor.nbytes, perf_counter() - t0)
        return source

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Non-blocking send; do not modify ``tensor`` until the handle's ``wait()`` returns."""
        self._check_tensor(tensor, "isend")
        dst = self._check_peer(dst, "isend", "dst")
        t0 = perf_counter()
        work = self._isend(tensor, dst, tag)
        self._stats.record("send", tensor.nbytes, 0, perf_counter() - t0)
        return work

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Non-blocking receive; ``wait()`` returns the source rank once ``tensor`` is filled."""
        self._check_tensor(tensor, "irecv")
        if src is not None:
            src = self._check_peer(src, "irecv", "src")
        t0 = perf_counter()
        work = self._irecv(tensor, src, tag)
        self._stats.record("recv", 0, tensor.nbytes, perf_counter() - t0)
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
            peer = self._check_peer(op.peer, "batch_isend_irecv", f"ops[{i}].peer")
            if type(op.peer) is not int:  # a NumPy integer: kept as a Python int
                ops[i] = replace(op, peer=peer)
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
