"""Point-to-point over one ``torch.distributed`` process group: the message hooks of
:class:`~dtlab.backends.torch_dist.TorchDistBackend` (``backend``, one rank of ``backend.group``).

Peers are named by their rank in the group; ``torch.distributed`` wants global ranks (it translates
a receive-from-any's source back). Every engine error goes through the backend's ``raise_failure``,
so a timeout or a dead peer names the message (peer and tag).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from dtlab.backends._torch_dist_support import Failures, _BatchWork, _DistWork, to_global, to_local
from dtlab.backends.types import P2POp, Work

__all__ = ["Peers", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


class Peers(Failures, Protocol):
    """One rank of a process group (a :class:`~dtlab.backends.torch_dist.TorchDistBackend` is one):
    its ``group`` (None: the default group) and how it reports an engine error."""

    @property
    def group(self) -> dist.ProcessGroup | None: ...


def _what(kind: str, peer: int | None, tag: int) -> str:
    """``send(dst=1, tag=0)``, ``recv(src=any, tag=3)``: how errors name one message."""
    side = "dst" if kind in ("send", "isend") else "src"
    return f"{kind}({side}={'any' if peer is None else peer}, tag={tag})"


def send(backend: Peers, tensor: torch.Tensor, dst: int, tag: int) -> None:
    group = backend.group
    try:
        dist.send(tensor, to_global(group, dst), group=group, tag=tag)
    except RuntimeError as exc:
        backend.raise_failure(exc, _what("send", dst, tag))


def recv(backend: Peers, tensor: torch.Tensor, src: int | None, tag: int) -> int:
    group = backend.group
    try:
        peer = None if src is None else to_global(group, src)
        source = dist.recv(tensor, peer, group=group, tag=tag)
    except RuntimeError as exc:
        backend.raise_failure(exc, _what("recv", src, tag))
    return to_local(group, source) if src is None else src


def isend(backend: Peers, tensor: torch.Tensor, dst: int, tag: int) -> Work:
    group = backend.group
    work = dist.isend(tensor, to_global(group, dst), group=group, tag=tag)
    return _DistWork(backend, work, _what("isend", dst, tag))


def irecv(backend: Peers, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
    group = backend.group
    peer = None if src is None else to_global(group, src)
    work = dist.irecv(tensor, peer, group=group, tag=tag)
    what = _what("recv", src, tag)
    if src is None:
        return _DistWork(backend, work, what, lambda: to_local(group, cast(Any, work).source_rank()))
    return _DistWork(backend, work, what, lambda: src)


def batch_isend_irecv(backend: Peers, ops: list[P2POp]) -> list[Work]:
    """``torch.distributed.batch_isend_irecv``: NCCL coalesces the batch into one group launch
    (then every op's handle waits for the whole batch), gloo posts each op."""
    group = backend.group
    p2p = [
        dist.P2POp(
            dist.isend if op.kind == "send" else dist.irecv,
            op.tensor,
            to_global(group, op.peer),
            group,
            op.tag,
        )
        for op in ops
    ]
    what = f"batch_isend_irecv({len(ops)} ops)"
    try:
        works = dist.batch_isend_irecv(p2p)
    except RuntimeError as exc:
        backend.raise_failure(exc, what)
    if len(works) == len(ops):
        return [
            _DistWork(
                backend,
                w,
                _what(op.kind, op.peer, op.tag),
                None if op.kind == "send" else (lambda peer=op.peer: peer),
            )
            for w, op in zip(works, ops, strict=True)
        ]
    batch = _BatchWork(works)  # coalesced: one handle for the whole batch
    return [
        _DistWork(backend, batch, what, None if op.kind == "send" else (lambda peer=op.peer: peer))
        for op in ops
    ]
