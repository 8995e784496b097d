"""Checked mode of the real engines (``backend.check_collectives``; ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
in spirit): before each collective the ranks all-gather a fixed-size row of ints describing the call
(kind, shape or element count, dtype, reduce op, root) and compare the rows. A difference raises
:class:`CollectiveMismatchError` on every rank, naming each rank's call, before any data moves, so
the ranks stay in step. Without it, MPI returns different tensors on each rank for a 1M vs 1M+7
``all_reduce``, and gloo aborts one process and reports a lost peer on the others.

On by default under ``dtlab.testing.spawn_world``; for users ``backend.check_collectives = True``,
the config's ``backend.check_collectives`` or ``DTLAB_CHECK_COLLECTIVES=1``. The in-memory world
always compares every call in its rendezvous and needs no extra exchange. The exchange is not
counted in ``backend.stats`` (those count what the operations themselves move).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from dtlab.backends._engine import Engine
from dtlab.backends.types import SUPPORTED_DTYPES, ReduceOp
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError

__all__ = [
    "ENV_VAR",
    "WIDTH",
    "CallChecks",
    "checks_from_env",
    "decode",
    "describe_call",
    "encode",
    "mismatch_hint",
]

ENV_VAR = "DTLAB_CHECK_COLLECTIVES"
WIDTH = 16  # ints per rank and call: 128 bytes
MAX_DIMS = 10  # a shape with more dimensions keeps the first 9 and the product of the rest
KINDS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "reduce_scatter",
    "all_gather",
    "all_gather_v",
    "all_to_all",
    "barrier",
    "broadcast_object",
    "all_gather_object",
    "new_group",
    "split",
)
# the fields of each kind's call tuple, as the in-memory world builds them and messages name them
FIELDS = {
    "all_reduce": ("shape", "dtype", "op"),
    "reduce": ("shape", "dtype", "op", "dst"),
    "broadcast": ("shape", "dtype", "src"),
    "reduce_scatter": ("output_numel", "dtype", "op"),
    "all_gather": ("input_numel", "dtype"),
    "all_gather_v": ("dtype",),
    "all_to_all": ("dtype",),
    "broadcast_object": ("src",),
    "new_group": ("ranks",),  # checked mode compares the kind only
}
_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_DTYPE_ID = {d: i for i, d in enumerate(SUPPORTED_DTYPES)}
_OP_ID = {op: i for i, op in enumerate(ReduceOp)}
_OPS = tuple(ReduceOp)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def checks_from_env() -> bool:
    """``DTLAB_CHECK_COLLECTIVES``: 1/true/yes/on or 0/false/no/off (unset: off)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: use 1 (check every collective) or 0 (do not)")


def describe_call(call: tuple[Any, ...] | None) -> str:
    """``("all_reduce", shape, dtype, op)`` -> ``all_reduce(shape=(4,), dtype=torch.float32, op=SUM)``."""
    if call is None:
        return "nothing (not arrived)"
    names = FIELDS.get(call[0], ())
    values = [
        v.name if isinstance(v, ReduceOp) else tuple(v) if isinstance(v, torch.Size) else v for v in call[1:]
    ]
    return f"{call[0]}(" + ", ".join(f"{n}={v}" for n, v in zip(names, values, strict=False)) + ")"


def mismatch_hint(checked: bool) -> str:
    """What an engine's timeout / lost-peer error adds about mismatched calls."""
    if checked:
        return " (checked mode: every rank's calls matched up to here)"
    return (
        "; ranks that call a collective with different shapes, dtypes, reduce ops or roots fail the "
        f"same way (gloo aborts a process on a size mismatch): set {ENV_VAR}=1 or "
        "backend.check_collectives=true to have such a mismatch named"
    )


def encode(call: tuple[Any, ...]) -> list[int]:
    """A call tuple (``("all_reduce", shape, dtype, op)``, see ``FIELDS``) as ``WIDTH`` ints."""
    kind = call[0]
    row = [_KIND_ID[kind]]
    for name, value in zip(FIELDS.get(kind, ()), call[1:], strict=False):
        if name == "ranks":
            break
        if name == "shape":
            dims = list(value)
            if len(dims) > MAX_DIMS:
                dims = [*dims[: MAX_DIMS - 1], math.prod(dims[MAX_DIMS - 1 :])]
            row += [len(value), *dims]
        elif name == "dtype":
            row.append(_DTYPE_ID.get(value, -1))
        elif name == "op":
            row.append(_OP_ID[value])
        else:
            row.append(int(value))
    return row + [0] * (WIDTH - len(row))


def decode(row: list[int]) -> tuple[Any, ...]:
    """The call tuple of an encoded row (a shape of more than ``MAX_DIMS`` dimensions: folded)."""
    kind = KINDS[row[0]] if 0 <= row[0] < len(KINDS) else f"unknown kind {row[0]}"
    out: list[Any] = [kind]
    i = 1
    for name in FIELDS.get(kind, ()):
        if name == "ranks":
            break
        if name == "shape":
            ndim = row[i]
            out.append(tuple(row[i + 1 : i + 1 + min(ndim, MAX_DIMS)]))
            i += 1 + min(ndim, MAX_DIMS)
        elif name == "dtype":
            out.append(SUPPORTED_DTYPES[row[i]] if 0 <= row[i] < len(SUPPORTED_DTYPES) else row[i])
            i += 1
        elif name == "op":
            out.append(_OPS[row[i]])
            i += 1
        else:
            out.append(row[i])
            i += 1
    return tuple(out)


class CheckState:
    """One backend's checked-mode buffers: the encoded rows of calls seen (bytes, at most
    ``_CACHE`` of them) and a host buffer for the gathered table, so a check costs a dict look-up, a
    byte copy, the all-gather and a byte comparison."""

    _CACHE = 256

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.count = 0
        self.rows: dict[tuple[Any, ...], bytes] = {}
        self.mine_buf = bytearray(WIDTH * 8)
        self.table_buf = bytearray(world_size * WIDTH * 8)
        self.mine = torch.frombuffer(self.mine_buf, dtype=torch.int64)
        self.table = torch.frombuffer(self.table_buf, dtype=torch.int64)
        self.on_device = device.type != "cpu"
        if self.on_device:  # the engine moves device tensors (NCCL): gather there, copy back
            self.mine_dev = torch.empty(WIDTH, dtype=torch.int64, device=device)
            self.table_dev = torch.empty(world_size * WIDTH, dtype=torch.int64, device=device)

    def row(self, call: tuple[Any, ...]) -> bytes:
        row = self.rows.get(call)
        if row is None:
            if len(self.rows) >= self._CACHE:
                self.rows.clear()
            row = self.rows[call] = torch.tensor(encode(call), dtype=torch.int64).numpy().tobytes()
        return row


class CallChecks(Engine):
    """Checked mode, a part of :class:`~dtlab.backends.base.CommunicationBackend`: before a collective,
    every rank compares a description of its call with every other rank's."""

    _check_state: CheckState | None

    def _agree(self, call: tuple[Any, ...]) -> None:
        """Compare ``call`` with every rank's (one all-gather of ``WIDTH`` ints); raise if any differs."""
        p = self.world_size
        if p == 1:
            return
        state = self._check_state
        if state is None:
            state = self._check_state = CheckState(p, self.device)
        state.count += 1
        row = state.row(call)
        state.mine_buf[:] = row
        try:
            if state.on_device:
                state.mine_dev.copy_(state.mine)
                self._all_gather(state.table_dev, state.mine_dev)
                state.table.copy_(state.table_dev)
            else:
                self._all_gather(state.table, state.mine)
        except CollectiveTimeoutError as exc:
            raise CollectiveTimeoutError(
                f"{exc} (raised while the ranks compared their calls before {describe_call(call)}, checked "
                f"collective #{state.count}: some rank did not reach a collective)",
                exc.missing_ranks,
                call[0],
            ) from exc
        if state.table_buf != row * p:
            raise _mismatch(self, self.rank, state, p)


def _mismatch(backend: object, rank: int, state: CheckState, p: int) -> CollectiveMismatchError:
    rows = state.table.view(p, WIDTH).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, got in enumerate(rows):
        groups.setdefault(tuple(got), []).append(r)
    listing = "; ".join(
        f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}: {describe_call(decode(list(got)))}"
        for got, who in groups.items()
    )
    return CollectiveMismatchError(
        f"rank {rank}: ranks called different collectives at checked collective #{state.count} of "
        f"{backend!r}: {listing}; nothing was exchanged (every rank raises this)"
    )
