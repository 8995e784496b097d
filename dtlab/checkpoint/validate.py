"""``meta.json`` checked like a config before anything it describes is read or allocated.

Every field :func:`dtlab.checkpoint.load.read_checkpoint` uses is checked for its type and a sane
range: the step (an integer, the one the step directory's name says), the world size, one entry per
saved rank, and for every file its size and SHA-256 (checked against the file on disk before it is
read). A document nested deeper than :data:`META_LIMITS` allows or holding an absurdly long string is
refused too. Every problem is a :class:`~dtlab.errors.CheckpointError` naming the file and the field,
so a resume treats the step directory as corrupt and falls back to an older one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dtlab.checkpoint.files import FORMAT_VERSION, shard_name, step_of
from dtlab.errors import CheckpointError
from dtlab.untrusted import TreeLimits, measure_tree, summary

__all__ = ["MAX_SHARD_BYTES", "MAX_STEP", "META_LIMITS", "check_meta", "parse_json"]

#: the largest step (and epoch) a checkpoint may record: integers JSON keeps exactly
MAX_STEP = 2**53
#: the largest world size a checkpoint may record
MAX_WORLD_SIZE = 1 << 20
#: the largest shard file read
MAX_SHARD_BYTES = 1 << 42
#: nesting, size and string length of a ``meta.json``
META_LIMITS = TreeLimits(depth=32, nodes=100_000_000, string=1 << 16)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_AGAIN = "resume from another step directory"


def parse_json(data: bytes, path: Path, limits: TreeLimits = META_LIMITS) -> Any:
    """The JSON document ``data`` (the file ``path``), within ``limits``; else a ``CheckpointError``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupted (not valid JSON: {exc}); {_AGAIN}") from None
    except RecursionError:
        raise CheckpointError(
            f"{path} is corrupted: nested deeper than JSON can be parsed (at most {limits.depth} levels "
            f"are read); {_AGAIN}"
        ) from None
    problem = measure_tree(doc, limits)
    if problem is not None:
        raise CheckpointError(f"{path} is corrupted: it holds {problem}; {_AGAIN}")
    return doc


def is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _bad(path: Path, field: str, value: Any, want: str) -> CheckpointError:
    return CheckpointError(f"{path} is corrupted: {field}={summary(value)}, expected {want}; {_AGAIN}")


def check_meta(meta: Any, path: Path, step_dir: Path) -> dict[str, Any]:
    """``meta`` (parsed from ``path`` in ``step_dir``) if every field read from it is sound."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is corrupted: it holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {summary(meta.get('format_version'))}, but this dtlab reads "
            f"format {FORMAT_VERSION}; load it with the dtlab version that wrote it"
        )
    missing = [k for k in ("step", "world_size", "ranks", "files") if k not in meta]
    if missing:
        raise CheckpointError(f"{path} is corrupted: missing {missing}; {_AGAIN}")
    step, world = meta["step"], meta["world_size"]
    if not is_int(step, 0, MAX_STEP):
        raise _bad(path, "step", step, f"an integer from 0 to {MAX_STEP}")
    if not is_int(world, 1, MAX_WORLD_SIZE):
        raise _bad(path, "world_size", world, f"an integer from 1 to {MAX_WORLD_SIZE}")
    named = step_of(step_dir.name)
    if named is not None and named != step:
        raise _bad(path, "step", step, f"{named}, the step its directory {step_dir.name} names")
    ranks, files = meta["ranks"], meta["files"]
    if not isinstance(ranks, list) or not 1 <= len(ranks) <= world:
        raise _bad(path, "ranks", ranks, f"a list of 1 to {world} entries (world_size)")
    if not isinstance(files, dict):
        raise _bad(path, "files", files, "an object of file name -> {bytes, sha256}")
    seen: set[int] = set()
    for i, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not is_int(entry.get("rank"), 0, world - 1):
            raise _bad(path, f"ranks[{i}]", entry, f"an object with a rank from 0 to {world - 1}")
        r = entry["rank"]
        if r in seen:
            raise _bad(path, f"ranks[{i}].rank", r, "each rank once")
        seen.add(r)
        if not isinstance(entry.get("model"), dict):
            raise _bad(path, f"ranks[{i}].model", entry.get("model"), "an object (shard metadata)")
        if entry.get("optim") is not None and not isinstance(entry["optim"], dict):
            raise _bad(path, f"ranks[{i}].optim", entry["optim"], "an object or null")
        kinds = ["model", "state"] + (["optim"] if entry.get("optim") is not None else [])
        for kind in kinds:
            _check_file(path, files, shard_name(kind, r))
    return meta


def _check_file(path: Path, files: dict[str, Any], name: str) -> None:
    info = files.get(name)
    if not isinstance(info, dict):
        raise _bad(path, f"files[{name!r}]", info, "an object {bytes, sha256}")
    if not is_int(info.get("bytes"), 0, MAX_SHARD_BYTES):
        raise _bad(
            path, f"files[{name!r}].bytes", info.get("bytes"), f"an integer from 0 to {MAX_SHARD_BYTES}"
        )
    sha = info.get("sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise _bad(path, f"files[{name!r}].sha256", sha, "64 lowercase hexadecimal digits")
