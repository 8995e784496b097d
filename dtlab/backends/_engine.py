"""``Engine``: what a concrete backend implements, under :class:`~dtlab.backends.base.CommunicationBackend`.

An engine (in-memory, MPI, torch.distributed) gives the device and the ``_``-prefixed hooks below
(and ``_new_group``, declared in ``_groups.py`` beside the type of group it makes), which move data
with arguments already checked; the public operations (``base.py``, ``_p2p.py``, ``_objects.py``,
``_groups.py``) check, call a hook and count bytes. The hooks with a body are
defaults an engine may replace where it does better (non-blocking collectives that overlap, a
coalesced batch of point-to-point operations, its own byte count for a padded all-gather).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from dtlab.backends.types import CompletedWork, P2POp, ReduceOp, Work

if TYPE_CHECKING:
    from dtlab.backends.stats import CommStats

__all__ = ["Engine", "finish_reduction"]


def finish_reduction(result: torch.Tensor, dest: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """After an engine's SUM for ``ReduceOp.AVG``: divide by ``world_size``; then copy ``result`` into
    ``dest`` when the engine reduced into a scratch buffer (``result is not dest``)."""
    if op is ReduceOp.AVG:
        result.div_(world_size)
    if result is not dest:
        dest.copy_(result)


class Engine(ABC):
    """The identity of a rank and the hooks an engine implements (the base of every part of
    ``CommunicationBackend``; ``CommunicationBackend.__init__`` sets the attributes)."""

    _rank: int
    _world_size: int
    _stats: CommStats
    _checked: bool  # checked mode is on (``check_collectives``)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where this rank's tensors live (``cpu`` or ``cuda:i``)."""

    if TYPE_CHECKING:  # what the parts of CommunicationBackend give one another

        def _check_tensor(self, t: object, op: str, name: str = "tensor") -> None: ...

        def _check_root(self, root: object, op: str, name: str) -> int: ...

        def _check_peer(self, peer: object, op: str, name: str) -> int: ...

        def _check_split(self, color: object, key: object) -> tuple[int | None, int]: ...

        def _agree(self, call: tuple[Any, ...]) -> None: ...

        def _all_gather_object(self, obj: Any) -> tuple[list[Any], list[int]]: ...

    # ------------------------------------------------------------------ hooks every engine implements
    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    @abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    @abstractmethod
    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]: ...

    @abstractmethod
    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int: ...

    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work: ...

    # ------------------------------------------------------------------ defaults an engine may replace
    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        """Default: each op posted non-blocking (engines whose ``_isend``/``_irecv`` never block:
        in-memory, MPI's ``Isend``/``Irecv``), receives first."""
        works: list[Work | None] = [None] * len(ops)
        for i, op in enumerate(ops):
            if op.kind == "recv":
                works[i] = self._irecv(op.tensor, op.peer, op.tag)
        for i, op in enumerate(ops):
            if op.kind == "send":
                works[i] = self._isend(op.tensor, op.peer, op.tag)
        return [w for w in works if w is not None]

    def _iall_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self._all_reduce(tensor, op)
        return CompletedWork()

    def _ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        self._reduce_scatter(output, input, op)
        return CompletedWork()

    def _iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self._all_gather(output, input)
        return CompletedWork()

    def _all_gather_v_bytes(self, counts: list[int], element_size: int) -> tuple[int, int]:
        """Bytes ``all_gather_v`` moved on this rank: a ring over the real counts (an engine with a
        variable-sized all-gather); engines that pad every contribution override it."""
        # rank r forwards every chunk but its successor's and receives every chunk but its own;
        # plus the exchange of the counts (one int64 per rank)
        p, total = self.world_size, sum(counts)
        sent = (total - counts[(self.rank + 1) % p]) * element_size + 8 * (p - 1)
        received = (total - counts[self.rank]) * element_size + 8 * (p - 1)
        return sent, received
