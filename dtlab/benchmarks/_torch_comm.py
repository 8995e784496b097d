"""The collectives torch issues in a step, and the bytes each rank sends, counted as dtlab's
``backend.stats`` counts its own (ring: an all-reduce of n bytes over p ranks sends 2(p-1)n/p, an
all-gather or reduce-scatter with a shard of n bytes (p-1)n): torch.distributed has no byte counter.

A dispatch mode sees the c10d ops (``dist.all_gather_into_tensor`` and the like, as FSDP2 calls them)
and the functional collectives (DTensor's redistributions and ``loss_parallel``'s reductions). It
declines every op on a DTensor, so that DTensor's own dispatch runs under the mode and the collectives
it issues inside an operator (``loss_parallel``'s) are seen too (``CommDebugMode`` does the same, but its
module tracker fails under FSDP2's hooks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TorchCollectives"]

_NAMESPACES = ("c10d", "_c10d_functional")
_KINDS = (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"))


def _group_size(args: Any) -> int:
    """The size of the op's group: a ProcessGroup argument (c10d ops) or a group name (functional ones)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for a in args:
        if isinstance(a, torch.ScriptObject):  # a boxed ProcessGroup
            return int(dist.ProcessGroup.unbox(a).size())
    names: list[Any] = [a for a in args if isinstance(a, str)]  # GroupName: a str
    if not names:
        raise ValueError(f"TorchCollectives: no process group among the arguments {args!r}")
    resolve = c10d._resolve_process_group  # type: ignore[attr-defined]  # noqa: SLF001 - torch's name lookup
    return int(resolve(names[-1]).size())


class TorchCollectives(TorchDispatchMode):
    """``with counter:`` a step; then ``counter.calls`` and ``counter.sent`` per kind (``all_reduce``,
    ``all_gather``, ``reduce_scatter``); another collective is counted in ``calls`` under its op name,
    its bytes not (``counter.uncounted`` lists it, so a total is never silently short)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches it, under this mode: its collectives are seen
        if func.namespace in _NAMESPACES:
            self._count(str(func.overloadpacket).split(".")[-1], list(args) + list((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: list[Any]) -> None:
        flat = name.replace("_", "")
        kind = next((k for key, k in _KINDS if key in flat), None)
        if kind is None:
            if name.lstrip("_") not in ("wait_tensor", "wrap_tensor_autograd", "barrier"):
                self.calls[name] = self.calls.get(name, 0) + 1
                self.uncounted.add(name)
            return
        p, ts = _group_size(args), [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        if kind == "all_reduce":
            moved = sum(2 * (p - 1) * t.nbytes // p for t in ts)
        elif name.endswith("_") and len(ts) == 2:  # c10d's in-place op: output and input, one the shard
            moved = (p - 1) * min(t.nbytes for t in ts)
        elif len(ts) == 1:  # functional: all-gather of a shard, reduce-scatter of the whole tensor
            moved = (p - 1) * (ts[0].nbytes if kind == "all_gather" else ts[0].nbytes // p)
        else:  # a coalesced form: its byte count is not read here
            self.calls[name] = self.calls.get(name, 0) + 1
            self.uncounted.add(name)
            return
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.sent[kind] = self.sent.get(kind, 0) + moved

    @property
    def bytes_sent(self) -> int | None:
        """The bytes this rank sent in every collective seen; ``None`` when one was not counted."""
        return None if self.uncounted else sum(self.sent.values())
