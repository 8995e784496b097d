"""A checkpoint's safetensors file read lazily, verified first: :class:`ShardFile` is the
:class:`~dtlab.core.state.TensorSource` behind a loaded checkpoint's tensors.

Verifying a file streams it once through SHA-256 in pieces of :data:`~dtlab.checkpoint.safe_files.PIECE`
bytes on the open descriptor, holding nothing but its header: its size and checksum must be those of
``meta.json``, then its header (8-byte length, JSON, then the data) must be sound as ``safetensors``
requires: known dtypes, sizes that match the shapes, data offsets that tile the data exactly (no gap, no
overlap, nothing past the end). Only then is any tensor of it read: each read opens the file again
(no link followed), checks that it is the file verified (device, inode, size, modification and change
times: a file replaced or written since is refused) and reads the bytes of the elements asked for, no
more. Every problem is one :class:`~dtlab.errors.CheckpointError` naming the file; no error quotes a
file's content.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtlab.checkpoint.safe_files import PIECE, open_inside, open_regular
from dtlab.errors import CheckpointError
from dtlab.untrusted import summary

__all__ = ["MAX_HEADER_BYTES", "ReadCounts", "ShardFile"]

#: the largest safetensors header read (safetensors' own limit)
MAX_HEADER_BYTES = 100_000_000
_MAX_DIMS = 64
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


@dataclass
class ReadCounts:
    """What one loaded checkpoint read: bytes read from disk (verification passes and tensor data), bytes
    of tensor data materialised, the names of the files verified (each streamed once through SHA-256)."""

    bytes_read: int = 0
    tensor_bytes: int = 0
    verified: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, read: int = 0, tensor: int = 0, file: str | None = None) -> None:
        with self.lock:
            self.bytes_read += read
            self.tensor_bytes += tensor
            if file is not None:
                self.verified.append(file)

    def __getstate__(self) -> dict[str, Any]:  # a copy (pickle, deepcopy) gets a lock of its own
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())


@dataclass(frozen=True)
class _Tensor:
    dtype: torch.dtype
    shape: list[int]
    begin: int  # byte offset in the file
    nbytes: int


def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"shard file {path} is not a valid safetensors file: {problem}")


def _entry(path: Path, name: Any, info: Any) -> tuple[str, int, int, torch.dtype, list[int]]:
    if not isinstance(name, str) or not isinstance(info, dict):
        raise _bad(path, "a tensor entry of its header is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _bad(path, f"tensor {summary(name)} has a dtype safetensors does not define")
    if not (
        isinstance(shape, list)
        and len(shape) <= _MAX_DIMS
        and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in shape)
    ):
        raise _bad(path, f"tensor {summary(name)} has a shape that is not a list of sizes")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 2**62 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise _bad(path, f"tensor {summary(name)} has data_offsets that are not [begin, end]")
    t = _DTYPES[dtype]
    if math.prod(shape) * t.itemsize != offsets[1] - offsets[0]:
        raise _bad(path, f"tensor {summary(name)} has {offsets[1] - offsets[0]} bytes for shape {shape}")
    return name, offsets[0], offsets[1], t, shape


def parse_header(head: bytes, size: int, path: Path) -> dict[str, _Tensor]:
    """The tensors of a safetensors file of ``size`` bytes from its first bytes ``head`` (its length and
    JSON header), checked as strictly as ``safetensors`` does."""
    n = int.from_bytes(head[:8], "little")
    try:
        doc = json.loads(head[8 : 8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad(path, "its header is not valid JSON") from None
    if not isinstance(doc, dict):
        raise _bad(path, "its header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "its __metadata__ is not an object of strings")
    entries = sorted((_entry(path, k, v) for k, v in doc.items()), key=lambda e: (e[1], e[2]))
    at, data = 0, size - 8 - n
    for name, begin, end, _, _ in entries:
        if begin != at:
            raise _bad(path, f"tensor {summary(name)} starts at byte {begin} of the data, not {at}")
        at = end
    if at != data:
        raise _bad(path, f"its tensors cover {at} bytes of data, the file holds {data}")
    return {name: _Tensor(t, shape, 8 + n + begin, end - begin) for name, begin, end, t, shape in entries}


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ShardFile:
    """One shard file of a step directory, verified before any tensor of it is read (see above);
    ``check`` runs once it is (the entries of ``meta.json`` against its header)."""

    def __init__(
        self,
        path: Path,
        root: Path,
        size: int,
        sha256: str,
        limit: int,
        counts: ReadCounts,
        allow_outside: bool = False,
        check: Callable[[], None] | None = None,
    ) -> None:
        self.path, self.root, self.size, self.sha256, self.limit = path, root, size, sha256, limit
        self.counts, self.allow_outside, self.check = counts, allow_outside, check
        self._tensors: dict[str, _Tensor] | None = None
        self._opened: tuple[Path, tuple[int, ...]] | None = None
        self._lock = threading.RLock()  # the check reads the header it set

    @property
    def verified(self) -> bool:
        return self._tensors is not None

    def verify(self) -> dict[str, _Tensor]:
        """Stream the file through SHA-256 (once) and check its header; its tensors."""
        with self._lock:
            if self._tensors is None:
                self._tensors = self._verify()
                if self.check is not None:
                    try:
                        self.check()
                    except CheckpointError:
                        self._tensors = None
                        raise
            return self._tensors

    def _verify(self) -> dict[str, _Tensor]:
        if not os.path.lexists(self.path):
            raise CheckpointError(
                f"shard file {self.path} is missing; the checkpoint is incomplete: resume from another "
                "step directory"
            )
        fd, actual, real = open_inside(self.path, self.root, "shard file", self.allow_outside)
        try:
            head, st = self._stream(fd, actual)
        except OSError as exc:
            raise CheckpointError(f"shard file {self.path} cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if actual < 8:
            raise _bad(self.path, f"{actual} bytes, shorter than a safetensors header")
        n = int.from_bytes(head[:8], "little")
        if n > min(MAX_HEADER_BYTES, actual - 8):
            raise _bad(self.path, f"its header length {n} exceeds the file or {MAX_HEADER_BYTES} bytes")
        tensors = parse_header(bytes(head), actual, self.path)
        self._opened = (real, _identity(st))
        return tensors

    def _stream(self, fd: int, actual: int) -> tuple[bytearray, os.stat_result]:
        """Hash the whole file on ``fd``, keeping its header's bytes only."""
        if actual != self.size:
            raise CheckpointError(
                f"shard file {self.path} is truncated or extended: {actual} bytes, expected {self.size}"
            )
        if actual > self.limit:
            raise CheckpointError(
                f"shard file {self.path} is {actual:,} bytes, more than the {self.limit:,} dtlab reads"
            )
        before = _identity(os.fstat(fd))
        h, head, keep, left = hashlib.sha256(), bytearray(), 8, actual
        while left > 0:
            piece = os.read(fd, min(PIECE, left))
            if not piece:
                raise CheckpointError(f"shard file {self.path} shrank while being read")
            h.update(piece)
            if len(head) < keep:
                head += piece[: keep - len(head)]
                if keep == 8 and len(head) == 8:  # the header's length: keep the header too (bounded)
                    n = int.from_bytes(head, "little")
                    keep = 8 + n if n <= min(MAX_HEADER_BYTES, actual - 8) else 8
                    head += piece[8:keep]
            left -= len(piece)
        self.counts.add(read=actual, file=self.path.name)
        if h.hexdigest() != self.sha256:
            raise CheckpointError(
                f"shard file {self.path} is corrupted: its SHA-256 differs from the one in meta.json"
            )
        st = os.fstat(fd)
        if _identity(st) != before:
            raise CheckpointError(f"shard file {self.path} changed while it was being verified; resume again")
        return head, st

    def info(self, name: str) -> tuple[list[int], torch.dtype] | None:
        t = self.verify().get(name)
        return None if t is None else (list(t.shape), t.dtype)

    def names(self) -> list[str]:
        return list(self.verify())

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        t = self.verify().get(name)
        if t is None:
            raise KeyError(name)
        numel = t.nbytes // t.dtype.itemsize if t.dtype.itemsize else 0
        if not 0 <= start <= end <= numel:
            raise CheckpointError(
                f"elements [{start}, {end}) are outside {summary(name)} ({numel}) in {self.path}"
            )
        n = (end - start) * t.dtype.itemsize
        if n == 0:
            return torch.empty(0, dtype=t.dtype)
        buf = bytearray(n)
        self._pread(buf, t.begin + start * t.dtype.itemsize)
        self.counts.add(read=n, tensor=n)
        return torch.frombuffer(buf, dtype=t.dtype)

    def _pread(self, buf: bytearray, offset: int) -> None:
        if self._opened is None:  # verify() sets it before any read
            raise CheckpointError(
                f"shard file {self.path} was read before it was verified; read it through verify()"
            )
        real, identity = self._opened
        fd, _ = open_regular(real, "shard file")
        try:
            if _identity(os.fstat(fd)) != identity:
                raise CheckpointError(
                    f"shard file {self.path} changed after it was verified (replaced or written to); "
                    "resume again"
                )
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    raise CheckpointError(f"shard file {self.path} shrank while being read")
                got += n
        except OSError as exc:
            raise CheckpointError(f"shard file {self.path} cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
