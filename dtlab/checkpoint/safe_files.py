"""Files from elsewhere, opened safely: what a checkpoint reads and how dtlab creates files.

Reading (:func:`read_inside`): the path must resolve inside the directory it belongs to (a step
directory inside the checkpoint directory, a shard inside its step directory) unless the caller allows
links outside; it is opened once, without following a link at its final component and without waiting
on a FIFO; the descriptor must be a regular file whose size (``fstat``) is what the caller expects and
within a bound, and the SHA-256 is computed in pieces of :data:`PIECE` bytes before the file is read
into memory. So a shard declared as 40 bytes that is 4 GiB on disk, a ``latest`` that is a link to a
huge file, or a file replaced by a FIFO is a :class:`~dtlab.errors.CheckpointError` after reading at
most one piece, and a file whose checksum differs is never held in memory whole. No error quotes a
file's content.

Writing (:func:`create_new`, :func:`replace_file`): a file is created with ``O_NOFOLLOW``; a file that
replaces another is written under a fresh name beside it and renamed over it, which replaces a
symbolic link at that name instead of writing through it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import uuid
from pathlib import Path
from typing import IO

from dtlab.errors import CheckpointError, UnsafePathError

__all__ = [
    "PIECE",
    "check_inside",
    "inside",
    "open_inside",
    "open_regular",
    "open_text",
    "read_inside",
    "replace_file",
    "write_new",
    "write_output",
]

#: bytes read at a time while hashing
PIECE = 1 << 20
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_ALLOW = "checkpoint.allow_outside_links=true allows links that leave the checkpoint directory"


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (links followed) to ``root`` or below it (also resolved)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def check_inside(path: Path, root: Path, what: str) -> None:
    """A :class:`CheckpointError` when ``path`` resolves outside ``root``."""
    if not inside(path, root):
        raise CheckpointError(
            f"{what} {path} resolves to {os.path.realpath(path)}, outside {root}; refusing to read it "
            f"({_ALLOW})"
        )


def open_regular(path: Path, what: str) -> tuple[int, int]:
    """``(descriptor, size)`` of the regular file ``path``; a link at its final component is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as exc:
        if os.path.islink(path):
            raise CheckpointError(f"{what} {path} is a symbolic link; refusing to follow it") from None
        raise CheckpointError(f"{what} {path} cannot be opened: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{what} {path} is not a regular file; refusing to read it")
    return fd, st.st_size


def open_inside(
    path: Path, root: Path | None, what: str, allow_outside: bool = False
) -> tuple[int, int, Path]:
    """``(descriptor, size, path opened)`` of the regular file ``path``, inside ``root`` unless
    ``allow_outside``; with a root the path is opened as resolved (and checked), so no link is followed
    after the check."""
    if root is not None and not allow_outside:
        check_inside(path, root, what)
    real = Path(os.path.realpath(path)) if root is not None else path
    fd, size = open_regular(real, what)
    return fd, size, real


def read_inside(
    path: Path,
    root: Path | None,
    what: str,
    *,
    limit: int,
    size: int | None = None,
    sha256: str | None = None,
    allow_outside: bool = False,
) -> bytes:
    """The bytes of ``path``: inside ``root`` (unless ``allow_outside``), a regular file of at most
    ``limit`` bytes, exactly ``size`` bytes and with this ``sha256`` when given (both checked before
    the file is held in memory). Every problem is one :class:`CheckpointError` naming the file."""
    fd, actual, _ = open_inside(path, root, what, allow_outside)
    try:
        return _read_fd(fd, actual, path, what, limit, size, sha256)
    except OSError as exc:
        raise CheckpointError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _read_fd(
    fd: int, actual: int, path: Path, what: str, limit: int, size: int | None, sha256: str | None
) -> bytes:
    if size is not None and actual != size:
        raise CheckpointError(f"{what} {path} is truncated or extended: {actual} bytes, expected {size}")
    if actual > limit:
        raise CheckpointError(f"{what} {path} is {actual:,} bytes, more than the {limit:,} dtlab reads")
    if sha256 is not None:
        h = hashlib.sha256()
        left = actual
        while left > 0:
            piece = os.read(fd, min(PIECE, left))
            if not piece:
                raise CheckpointError(f"{what} {path} shrank while being read")
            h.update(piece)
            left -= len(piece)
        if h.hexdigest() != sha256:
            raise CheckpointError(
                f"{what} {path} is corrupted: its SHA-256 differs from the one in meta.json"
            )
        os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read(actual)
    if len(data) != actual:
        raise CheckpointError(f"{what} {path} shrank while being read")
    return data


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist: ``O_EXCL``, no link followed), write ``data``, fsync."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
    except FileExistsError:
        raise UnsafePathError(
            f"{path} appeared while dtlab was creating it (a link or a file planted there?); nothing "
            "was written through it"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a fresh file beside it, fsynced, renamed over it. A
    symbolic link at ``path`` is replaced by the file, never written through; a directory at
    ``path`` or a parent that is not a directory is an :class:`UnsafePathError` naming it."""
    if path.is_dir() and not path.is_symlink():
        raise UnsafePathError(f"{path} is a directory; give a file name (e.g. {path / 'model.safetensors'})")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise UnsafePathError(f"{path}: {parent} is not a directory")
    tmp = parent / f".tmp-{path.name[:100]}-{uuid.uuid4().hex[:8]}"
    try:
        write_new(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_output(path: Path, data: bytes, shown: str) -> None:
    """:func:`replace_file` for an output the user named (``shown``: as given, e.g. ``-o out.png``), its
    directory made first; where nothing can be written there (a read-only directory, /proc, a parent
    that is a file) one :class:`UnsafePathError` naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, data)  # a link at ``path`` is replaced by the file, its target left untouched
    except OSError as exc:
        raise UnsafePathError(
            f"{shown} cannot be written: {exc.strerror or exc}; choose a file in a directory this user "
            "can write"
        ) from None


def _refuse_link(path: Path, fix: str) -> UnsafePathError:
    return UnsafePathError(f"{path} is a symbolic link; dtlab does not write through links: {fix}")


def open_text(path: Path, append: bool, fix: str = "remove the link") -> IO[str]:
    """``path`` opened for writing text (appending, or truncated), never through a symbolic link at
    its final component and never blocking on a FIFO: either is an :class:`UnsafePathError` naming
    the file (with ``fix``), and so is anything but a regular file."""
    flags = os.O_WRONLY | os.O_CREAT | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
    flags |= os.O_APPEND if append else 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise _refuse_link(path, fix) from None
        raise UnsafePathError(f"{path} cannot be opened for writing: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file; dtlab writes only regular files: {fix}")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_NONBLOCK)
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "a" if append else "w", encoding="utf-8", newline="")
