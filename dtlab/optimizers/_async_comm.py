"""The message protocol of :class:`~dtlab.optimizers.async_sgd.AsyncSGDOptimizer`.

Three tags tell the message kinds apart; every message has a fixed size known to both sides:

* ``TAG_PUSH`` (worker -> server): one tensor of the parameters' dtype, a header (two int64: kind
  ``PUSH`` or ``FINISH``, and the worker's clock; then one byte per parameter piece in that server's
  shard, 1 where the worker's parameter had a gradient, padded to whole elements) followed by the
  gradient shard. A server receives it from any source, so pushes and finishes share this one tag.
* ``TAG_NOTE`` (server -> worker): int64 ``[kind, clock, slowest, W pushed counts]``. ``READY``: the
  parameters for ``clock`` follow on ``TAG_PARAMS``; ``WAIT``: the worker is held back by the
  staleness bound, and the counts say which workers it waits for (``-1``: finished). A server sends a
  new ``WAIT`` note whenever that set changes, so a waiting worker's last note names who holds it.
  ``ABORT``: the server heard nothing within its timeout; the counts flag (1) the workers it names as
  dead or hung, and the server raises after sending it.
* ``TAG_PARAMS`` (server -> worker): the parameter shard.
"""

from __future__ import annotations

from time import perf_counter

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import CollectiveTimeoutError

__all__ = [
    "ABORT",
    "FINISH",
    "PUSH",
    "READY",
    "TAG_NOTE",
    "TAG_PARAMS",
    "TAG_PUSH",
    "WAIT",
    "Note",
    "PushMessage",
    "behind",
    "peer_lost",
    "pieces_of",
    "recv_from_server",
]

TAG_PUSH, TAG_NOTE, TAG_PARAMS = 27_001, 27_002, 27_003
PUSH, FINISH = 1, 2  # kinds of a push message
READY, WAIT, ABORT = 1, 2, 3  # kinds of a note
_HEADER_BYTES = 16
_NOTE_FIELDS = 3  # kind, clock, slowest; then one pushed count per worker


def pieces_of(numels: list[int], shard_numel: int, server: int) -> list[tuple[int, int, int]]:
    """``(parameter index, offset in the shard, length)`` of each parameter's piece in ``server``'s
    shard of the flat parameters (parameters of ``numels`` elements laid end to end)."""
    lo, hi = server * shard_numel, (server + 1) * shard_numel
    out, offset = [], 0
    for i, n in enumerate(numels):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append((i, a - lo, b - a))
        offset += n
    return out


class PushMessage:
    """A worker's message to one server: ``[kind, clock]`` as int64 and one flag byte per parameter
    piece of the shard (``pieces``: 1 where the worker had a gradient), then ``shard_numel`` values."""

    def __init__(self, shard_numel: int, dtype: torch.dtype, device: torch.device, pieces: int = 0) -> None:
        es = torch.empty((), dtype=dtype).element_size()
        self.header_numel = -(-(_HEADER_BYTES + pieces) // es)
        self.buffer = torch.zeros(self.header_numel + shard_numel, dtype=dtype, device=device)
        self._header = self.buffer[: _HEADER_BYTES // es].view(torch.int64)
        self.flags = self.buffer[_HEADER_BYTES // es : self.header_numel].view(torch.uint8)[:pieces]
        self.payload = self.buffer[self.header_numel :]

    def set(self, kind: int, clock: int) -> None:
        self._header[0], self._header[1] = kind, clock

    @property
    def kind(self) -> int:
        return int(self._header[0])

    @property
    def clock(self) -> int:
        return int(self._header[1])

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


class Note:
    """A server's note to a worker: ``[kind, clock, slowest, pushed_0 .. pushed_{W-1}]`` (int64)."""

    def __init__(self, workers: int, device: torch.device) -> None:
        self.tensor = torch.zeros(_NOTE_FIELDS + workers, dtype=torch.int64, device=device)

    @classmethod
    def make(
        cls, kind: int, clock: int, slowest: int, pushed: list[int], device: torch.device
    ) -> torch.Tensor:
        values = [kind, clock, slowest, *pushed]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @property
    def kind(self) -> int:
        return int(self.tensor[0])

    @property
    def clock(self) -> int:
        return int(self.tensor[1])

    @property
    def slowest(self) -> int:
        return int(self.tensor[2])

    def pushed(self) -> list[int]:
        return [int(v) for v in self.tensor[_NOTE_FIELDS:].tolist()]

    @staticmethod
    def nbytes(workers: int) -> int:
        return 8 * (_NOTE_FIELDS + workers)


def behind(pushed: list[int], clock: int, staleness: int, first_worker: int) -> list[int]:
    """Ranks of the unfinished workers (``pushed[i] >= 0``) that hold back a read at ``clock``."""
    return [first_worker + i for i, n in enumerate(pushed) if 0 <= n < clock - staleness]


def peer_lost(exc: BaseException) -> bool:
    """Whether a backend error says the peer's process died (gloo: its connection closed)."""
    return "peer process died" in str(exc)


def bounded(backend: CommunicationBackend) -> str:
    """How long one receive may wait on ``backend`` (for error messages)."""
    timeout = getattr(backend, "timeout", None)
    return f"{timeout:g}s" if isinstance(timeout, int | float) else "the backend's timeout"


def recv_from_server(
    backend: CommunicationBackend,
    tensor: torch.Tensor,
    server: int,
    tag: int,
    held: list[int] | None,
    clock: int,
    staleness: int | None,
) -> None:
    """A worker's bounded receive from ``server``; a timeout names the workers the server's last WAIT
    note said the read waits for (``held``), or else the server."""
    t0 = perf_counter()
    try:
        backend.recv(tensor, server, tag)
    except CollectiveTimeoutError as exc:
        me = f"AsyncSGDOptimizer worker rank {backend.rank}"
        timeout = getattr(backend, "timeout", None)
        # a server that timed out waiting for the held-back workers closes its connections (gloo)
        # about one timeout after its last note; a connection lost well before then: it died
        died = peer_lost(exc) and isinstance(timeout, int | float) and perf_counter() - t0 < timeout / 2
        if held and not died:
            how = (
                f"lost the connection to server rank {server}"
                if peer_lost(exc)
                else f"got nothing from server rank {server} within {bounded(backend)}"
            )
            raise CollectiveTimeoutError(
                f"{me}: {how} while its last note said the clock-{clock} read waits (staleness="
                f"{staleness}) for worker rank(s) {held}: they are dead or hung, or server rank "
                f"{server} is ({exc})",
                tuple(held),
                "AsyncSGDOptimizer.step",
            ) from exc
        raise CollectiveTimeoutError(
            f"{me}: no answer from server rank {server} within {bounded(backend)} "
            f"(clock {clock}): server rank {server} is dead or hung ({exc})",
            (server,),
            "AsyncSGDOptimizer.step",
        ) from exc
