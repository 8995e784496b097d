"""What :class:`~dtlab.optimizers.elastic.ElasticOptimizer` commits, where commits are held, and how a
commit reaches the ring neighbour.

A commit is one rank's model and optimizer shards (its :class:`ShardedState` pieces, compression state
included) plus the trainer-level JSON state (data position, LR schedule, counters), encoded once as
safetensors bytes: an encoded commit is a frozen copy that training cannot change afterwards. It is
named by :class:`CommitKey` ``(step, generation, world_size, rank)``: the rank whose shards it holds
in the world that made it (``generation`` counts the worlds of a job, so the re-commit right after a
restore at the same step is told apart from the commit it was restored from).

Stores: :class:`MemoryCommitStore` (in memory, the in-memory engine and any process that lives on)
and :class:`DiskCommitStore` (a node-local directory, for launchers that restart workers as new
processes, e.g. torchrun elastic). A store holds this rank's own commit and its ring neighbour's copy.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint.files import durable_write, fsync_dir
from dtlab.checkpoint.safe_files import read_inside
from dtlab.checkpoint.validate import MAX_SHARD_BYTES, MAX_STEP, META_LIMITS, is_int
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError
from dtlab.untrusted import measure_tree, summary

__all__ = [
    "Commit",
    "CommitKey",
    "CommitStore",
    "DiskCommitStore",
    "MemoryCommitStore",
    "decode_commit",
    "encode_commit",
    "ring_exchange",
]

_FORMAT = 1
_META_KEY = "dtlab_elastic_commit"
_STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's, not a sharing node's
_RING_TAG = 7411  # point-to-point tag of the ring copy (distinct from strategies' own tags)


class CommitKey(NamedTuple):
    """Names one rank's commit: ``rank`` of a ``world_size``-rank world, generation ``generation``."""

    step: int
    generation: int
    world_size: int
    rank: int


@dataclass
class Commit:
    """One rank's committed state (decoded)."""

    key: CommitKey
    model: ShardedState
    optim: ShardedState
    #: trainer-level JSON state given to the commit (data position, LR schedule, step counters)
    state: dict[str, Any] = field(default_factory=dict)


def encode_commit(commit: Commit) -> bytes:
    """Safetensors bytes: tensors ``m.<key>`` / ``o.<key>``, everything else as JSON metadata."""
    tensors = {f"m.{k}": v for k, v in commit.model.tensors.items()}
    tensors.update({f"o.{k}": v for k, v in commit.optim.tensors.items()})
    # clone: safetensors refuses tensors sharing storage (flat slices of one buffer)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    header = {
        "format": _FORMAT,
        "key": list(commit.key),
        "model": commit.model.metadata,
        "optim": commit.optim.metadata,
        "state": commit.state,
    }
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"elastic commit of rank {commit.key.rank} at step {commit.key.step}: the state is not "
            f"JSON-serialisable ({exc}); commit only JSON values (lists, numbers, strings, dicts)"
        ) from None
    return bytes(st_save(tensors, metadata={_META_KEY: text}))


def _header(data: bytes) -> dict[str, Any]:
    """The commit's JSON header, checked like a config: bounded, nested within limits, each field of
    the type the decoder reads (a :class:`CheckpointError` naming the field otherwise)."""
    if len(data) < 8:
        raise CheckpointError(f"an elastic commit of {len(data)} bytes is truncated")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CheckpointError(f"an elastic commit's header claims {n} bytes of its {len(data)}: truncated")
    try:
        meta = json.loads(data[8 : 8 + n])["__metadata__"]
        header: Any = json.loads(meta[_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"not an elastic commit (bad header: {exc})") from None
    except RecursionError:
        raise CheckpointError("not an elastic commit (its header is nested too deeply)") from None
    problem = measure_tree(header, META_LIMITS)
    if problem is not None:
        raise CheckpointError(f"not an elastic commit: its header holds {problem}")
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise CheckpointError(f"elastic commit format {summary(got)}, expected {_FORMAT}")
    key = header.get("key")
    if not isinstance(key, list) or len(key) != 4 or not all(is_int(v, 0, MAX_STEP) for v in key):
        raise CheckpointError(
            f"elastic commit key {summary(key)}: expected 4 integers (step, generation, size, rank)"
        )
    for part in ("model", "optim", "state"):
        if not isinstance(header.get(part), dict):
            raise CheckpointError(f"elastic commit {part}={summary(header.get(part))}: expected an object")
    return header


def commit_key(data: bytes) -> CommitKey:
    """The key of an encoded commit, read from its header only."""
    return CommitKey(*(int(v) for v in _header(data)["key"]))


def decode_commit(data: bytes) -> Commit:
    header = _header(data)
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        raise CheckpointError(f"elastic commit {header['key']} is not valid safetensors: {exc}") from None
    model = {k[2:]: v for k, v in tensors.items() if k.startswith("m.")}
    optim = {k[2:]: v for k, v in tensors.items() if k.startswith("o.")}
    return Commit(
        CommitKey(*(int(v) for v in header["key"])),
        ShardedState(model, header["model"]),
        ShardedState(optim, header["optim"]),
        header["state"],
    )


def ring_exchange(backend: CommunicationBackend, payload: bytes, offset: int = 1) -> bytes:
    """Send ``payload`` to rank ``r + offset`` and return rank ``r - offset``'s (modulo the world size).

    Non-blocking sends posted before the receives, so no engine's rendezvous send can deadlock the
    ring; the size travels first, then the bytes."""
    p, r = backend.world_size, backend.rank
    nxt, prev = (r + offset) % p, (r - offset) % p
    dev = backend.device
    size_out = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    size_in = torch.zeros(1, dtype=torch.int64, device=dev)
    send = backend.isend(size_out, nxt, tag=_RING_TAG)
    backend.irecv(size_in, prev, tag=_RING_TAG).wait()
    send.wait()
    out = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    inp = torch.empty(int(size_in.item()), dtype=torch.uint8, device=dev)
    send = backend.isend(out, nxt, tag=_RING_TAG + 1)
    backend.irecv(inp, prev, tag=_RING_TAG + 1).wait()
    send.wait()
    return inp.cpu().numpy().tobytes()


def _same_world(a: CommitKey, b: CommitKey) -> bool:
    return (a.step, a.generation, a.world_size) == (b.step, b.generation, b.world_size)


class CommitStore:
    """Where a rank's held commits live: its own and its ring neighbour's, by :class:`CommitKey`."""

    def put(self, data: bytes) -> CommitKey:
        raise NotImplementedError

    def keys(self) -> list[CommitKey]:
        raise NotImplementedError

    def get(self, key: CommitKey) -> bytes:
        raise NotImplementedError

    def keep_only(self, world: CommitKey) -> None:
        """Drop every held commit not made by ``world``'s world (same step, generation, size)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the commits held."""
        raise NotImplementedError


class MemoryCommitStore(CommitStore):
    """Commits held in this process's memory (lost with it: the ring copy on the neighbour is what
    survives a lost rank)."""

    def __init__(self) -> None:
        self._held: dict[CommitKey, bytes] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes) -> CommitKey:
        key = commit_key(data)
        with self._lock:
            self._held[key] = data
        return key

    def keys(self) -> list[CommitKey]:
        with self._lock:
            return sorted(self._held)

    def get(self, key: CommitKey) -> bytes:
        with self._lock:
            return self._held[key]

    def keep_only(self, world: CommitKey) -> None:
        with self._lock:
            for k in [k for k in self._held if not _same_world(k, world)]:
                del self._held[k]

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())


_FILE = re.compile(r"^commit-s(\d+)-g(\d+)-r(\d+)of(\d+)\.safetensors$")


class DiskCommitStore(CommitStore):
    """Commits held as files in a directory, meant to be node-local (``/tmp`` or a local SSD): each
    file is written to a temporary name, fsynced and renamed, so a process killed mid-write leaves the
    previous commits intact. Several nodes may share one directory (same key, same bytes)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-*"):  # left by a process killed mid-write
            try:
                if time.time() - stale.stat().st_mtime > _STALE_TMP_S:
                    stale.unlink()
            except FileNotFoundError:
                pass

    @staticmethod
    def _name(key: CommitKey) -> str:
        s, g, r, p = key.step, key.generation, key.rank, key.world_size
        return f"commit-s{s:08d}-g{g:04d}-r{r:05d}of{p:05d}.safetensors"

    def put(self, data: bytes) -> CommitKey:
        key = commit_key(data)
        final = self.directory / self._name(key)
        tmp = self.directory / f".tmp-{uuid.uuid4().hex[:12]}-{final.name}"
        durable_write(tmp, data)
        os.replace(tmp, final)
        fsync_dir(self.directory)
        return key

    def keys(self) -> list[CommitKey]:
        out = []
        for p in self.directory.iterdir():
            m = _FILE.match(p.name)
            if m:
                step, gen, rank, ws = (int(g) for g in m.groups())
                out.append(CommitKey(step, gen, ws, rank))
        return sorted(out)

    def get(self, key: CommitKey) -> bytes:
        path = self.directory / self._name(key)
        data = read_inside(path, self.directory, "elastic commit", limit=MAX_SHARD_BYTES)
        if commit_key(data) != key:
            raise CheckpointError(f"{path} holds commit {commit_key(data)}, not {key}")
        return data

    def keep_only(self, world: CommitKey) -> None:
        for key in self.keys():
            if not _same_world(key, world):
                try:
                    (self.directory / self._name(key)).unlink()
                except FileNotFoundError:
                    pass  # another node sharing the directory removed it

    def nbytes(self) -> int:
        total = 0
        for key in self.keys():
            try:
                total += (self.directory / self._name(key)).stat().st_size
            except FileNotFoundError:
                pass
        return total
