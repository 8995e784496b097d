"""The checkpoint commit stopped at every point of its protocol, not at random: each file-system step of
``save_checkpoint`` (a directory made, a file written, a rename, the ``latest`` pointer replaced, a
directory deleted) is wrapped so that the save raises right after it, or tears a file write in half.
After each stop: ``latest``, when present, names a step directory that verifies; a strict resume takes
the newest committed step with the values saved there (nothing committed is lost, nothing
uncommitted is taken); and the next save succeeds and leaves no leftovers."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import flat_shard

import dtlab.checkpoint.save as save_module
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards, read_checkpoint, save_checkpoint
from dtlab.checkpoint.load import read_latest
from dtlab.checkpoint.resume import find_resume_checkpoint
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError
from dtlab.testing import run_world

FULL = {"w": torch.arange(10, dtype=torch.float32).reshape(2, 5), "b": torch.tensor([7.0, 8.0, 9.0])}


class Stop(Exception):
    """The process stops here (raised by the wrapped file-system step)."""


class FileSystemSteps:
    """Wraps the file-system calls ``save_checkpoint`` makes; counts them (``names``) and stops the
    save right after step ``stop_after`` (0-based), or tears write ``stop_after`` (half its bytes)."""

    def __init__(self, stop_after: int | None = None, torn: bool = False) -> None:
        self.stop_after, self.torn = stop_after, torn
        self.names: list[str] = []
        self._lock = threading.Lock()

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                index = len(self.names)
                self.names.append(f"{name} {Path(args[0]).name}")
            if index == self.stop_after and self.torn and name == "write":
                Path(args[0]).write_bytes(args[1][: len(args[1]) // 2])
                raise Stop(f"torn {self.names[index]}")
            out = real(*args, **kwargs)
            if index == self.stop_after:
                raise Stop(f"after {self.names[index]}")
            return out

        return step

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(save_module, "durable_write", self.wrap("write", save_module.durable_write))
        mp.setattr(os, "rename", self.wrap("rename", os.rename))
        mp.setattr(os, "replace", self.wrap("replace", os.replace))
        mp.setattr(shutil, "rmtree", self.wrap("rmtree", shutil.rmtree))
        real_mkdir = Path.mkdir
        mp.setattr(Path, "mkdir", self.wrap("mkdir", real_mkdir))


def _save(backend: CommunicationBackend, root: Path, step: int) -> None:
    shard = flat_shard(FULL, backend.rank, backend.world_size, step)
    optim = flat_shard(FULL, backend.rank, backend.world_size, -step)
    rank_state = {"marker": torch.tensor([float(step)])}
    # one run saving again and again (its run_tag): a save removes its own run's leftovers, never another's
    meta = {"trainer": {"step": step}}
    save_checkpoint(root, step, backend, shard, optim, rank_state, meta, keep_last=2, run_tag="crashrun")


def _committed(root: Path) -> int | None:
    """The step ``latest`` names, checking that it verifies (the pointer never names less)."""
    name = read_latest(root)
    if name is None:
        return None
    try:
        return read_checkpoint(root / name).step
    except CheckpointError as exc:
        raise AssertionError(f"latest names {name}, which does not verify: {exc}") from None


def _check_resume(root: Path, step: int) -> None:
    point = find_resume_checkpoint(root, strict=True)
    assert point.checkpoint is not None and point.checkpoint.step == step
    full = full_tensors_from_shards(point.checkpoint.model)
    for k, v in FULL.items():
        assert torch.equal(full[k], v * step), (k, step)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_save_stopped_after_any_file_system_step_loses_nothing_committed(
    world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the steps of a save that replaces nothing and prunes one older step directory
    probe = tmp_path / "probe"
    for step in (1, 2):
        run_world(world_size, _save, probe, step)
    base = tmp_path / "base"  # steps 1 and 2 saved: each stopped save starts from a copy
    shutil.copytree(probe, base, symlinks=True)
    counted = FileSystemSteps()
    with monkeypatch.context() as mp:
        counted.install(mp)
        run_world(world_size, _save, probe, 3)
    names = counted.names
    assert any(n.startswith("replace") for n in names) and any(n.startswith("rmtree") for n in names)
    assert len(names) >= 8, names
    seen_commit = set()
    for stop_after in range(len(names)):
        for torn in (False, True):
            if torn and not names[stop_after].startswith("write"):
                continue
            root = tmp_path / f"ck{stop_after}{'t' if torn else ''}"
            shutil.copytree(base, root, symlinks=True)
            crash = FileSystemSteps(stop_after, torn)
            with monkeypatch.context() as mp:
                crash.install(mp)
                with pytest.raises(Exception, match=r"torn|after") as info:
                    run_world(world_size, _save, root, 3, timeout=60)
            where = f"stopped {info.value.__cause__ or info.value} (step {stop_after} of {names})"
            committed = _committed(root)
            assert committed in (2, 3), where
            seen_commit.add(committed)
            _check_resume(root, committed)
            # the committed step and the one before it stay readable until the next save prunes
            assert read_checkpoint(root / "step_00000002").step == 2, where
            # the next save takes over: it commits, and leaves nothing of the stopped one behind
            run_world(world_size, _save, root, 4)
            assert _committed(root) == 4, where
            _check_resume(root, 4)
            assert not list(root.glob(".tmp-*")), (where, sorted(p.name for p in root.iterdir()))
    assert seen_commit == {2, 3}  # the sweep stopped both before and after the commit point


def _save_meta(backend: CommunicationBackend, root: Path, meta: dict[str, Any]) -> None:
    shard = flat_shard(FULL, backend.rank, backend.world_size, 1)
    save_checkpoint(root, 1, backend, shard, None, {}, meta)


def test_metadata_json_would_change_is_refused_before_anything_is_committed(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not survive a JSON round trip") as info:
        run_world(1, _save_meta, tmp_path / "ck", {"trainer": {"counts": {1: 2}}})  # int keys
    assert isinstance(info.value.__cause__, CheckpointError)
    assert read_latest(tmp_path / "ck") is None and not list((tmp_path / "ck").glob("step_*"))


def test_shards_that_leave_one_element_uncovered_are_refused() -> None:
    """Two copies of the same piece hold as many elements as the tensor, yet one element is missing."""
    from dtlab.core.shard_index import ShardIndex

    def piece(start: int, end: int) -> ShardedState:
        entries = {"w": {"shape": [5], "dtype": "float32", "start": start, "end": end}}
        meta = {"strategy": "test", "world_size": 2, "rank": 0, "entries": entries}
        return ShardedState({"w": torch.arange(start, end, dtype=torch.float32)}, meta)

    assert torch.equal(ShardIndex([piece(0, 3), piece(3, 5)]).full("w"), torch.arange(5.0))
    with pytest.raises(CheckpointError, match="cover only 4 of elements"):
        ShardIndex([piece(0, 4), piece(0, 4)]).full("w")


class PeerDied(Exception):
    """Rank 1's process ends here, in the middle of its shard writes (the world aborts)."""


def test_a_peer_dying_mid_save_leaves_no_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a leftover of a broken-off save is never removed: a resumed run has another run_tag
    root = tmp_path / "ck"
    run_world(2, _save, root, 1)
    real = save_module.durable_write

    def write(path: Path, data: bytes) -> None:
        if Path(path).name.startswith("optim_rank00001"):  # after its model shard, before the rest
            raise PeerDied("rank 1 died")
        real(path, data)

    monkeypatch.setattr(save_module, "durable_write", write)
    with pytest.raises(Exception, match="rank 1") as info:
        run_world(2, _save, root, 2, timeout=30)
    assert isinstance(info.value.__cause__, PeerDied), info.value
    assert not list(root.glob(".tmp-*")), sorted(p.name for p in root.iterdir())
    assert _committed(root) == 1
    _check_resume(root, 1)
