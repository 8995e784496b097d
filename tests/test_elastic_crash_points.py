"""The elastic commit stopped at every point of its protocol, on every rank in turn, and recovery with
each rank's piece of the newest commit missing in turn.

A commit is: this rank's piece into its store, the ring copy to rank + 1 into that rank's store, a
barrier, then the older commits dropped. A rank stopped between any two of these (its in-memory store
lost with it) leaves the survivors a newest complete commit: the restore takes exactly that one, with
the values training had at that step, never a commit missing a rank's piece, and never loses a commit
every rank acknowledged."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic_cases import elastic_fsdp, full_state
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import RankFailedError
from dtlab.optimizers.elastic import (
    CommitKey,
    CommitStore,
    DiskCommitStore,
    MemoryCommitStore,
    StaticMember,
    decode_commit,
)
from dtlab.testing import run_world

WORLD = 4
#: the points of one rank's commit at which it stops (raises), in protocol order
POINTS = ("before own piece", "after own piece", "after ring copy", "after dropping older")


class Stopped(Exception):
    """The rank stops here."""


class StoppingStore(CommitStore):
    """A real store that stops its rank at ``point`` of the commit of step ``step``."""

    def __init__(self, inner: CommitStore, step: int | None = None, point: str = "") -> None:
        self.inner, self.step, self.point = inner, step, point
        self._puts = 0

    def _stop(self, point: str, key: CommitKey) -> None:
        if key.step == self.step and point == self.point:
            raise Stopped(f"{point} of step {key.step}")

    def put(self, data: bytes) -> CommitKey:
        key = decode_commit(data).key
        if key.step == self.step:
            self._puts += 1
            if self._puts == 1:
                self._stop("before own piece", key)
                if self.point == "own piece half written" and isinstance(self.inner, DiskCommitStore):
                    # the disk store's first step: a temporary file, renamed into place only when whole
                    tmp = self.inner.directory / f".tmp-stopped-{key.rank}"
                    tmp.write_bytes(data[: len(data) // 2])
                    raise Stopped(f"own piece half written, step {key.step}")
        out = self.inner.put(data)
        self._stop("after own piece" if self._puts == 1 else "after ring copy", key)
        return out

    def keys(self) -> list[CommitKey]:
        return self.inner.keys()

    def get(self, key: CommitKey) -> bytes:
        return self.inner.get(key)

    def keep_only(self, world: CommitKey) -> None:
        self.inner.keep_only(world)
        self._stop("after dropping older", world)

    def nbytes(self) -> int:
        return self.inner.nbytes()


def _train(backend: CommunicationBackend, stores: list[CommitStore], steps: int) -> Any:
    """``steps`` steps committing every 2; the full state after each committed step."""
    opt = elastic_fsdp(backend, StaticMember(stores[backend.rank]))
    g = torch.Generator().manual_seed(backend.rank)
    states = {}
    for step in range(1, steps + 1):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(opt.model(x), y).backward()
        opt.step()
        if step % 2 == 0:
            states[step] = full_state(opt)  # before the commit: a stop there must not matter
        opt.end_step(step, state={"step": step})
    assert opt.commit_count == steps // 2 and opt.last_commit is not None  # what the metrics report
    assert opt.last_commit.step == steps - steps % 2
    return states


def _restore(backend: CommunicationBackend, stores: list[CommitStore]) -> Any:
    opt = elastic_fsdp(backend, StaticMember(stores[backend.rank]))
    commit = opt.restore()
    assert commit is not None
    return commit.key.step, commit.state, full_state(opt)


def _newest_complete(stores: Sequence[CommitStore]) -> int:
    """The oracle: the newest step whose every rank's piece some store holds."""
    held = {k for s in stores for k in s.keys()}
    steps = sorted({k.step for k in held}, reverse=True)
    for step in steps:
        if all(any(k.step == step and k.rank == r for k in held) for r in range(WORLD)):
            return step
    raise AssertionError(f"no complete commit in {sorted(held)}")


@pytest.fixture(scope="module")
def trained() -> dict[int, dict[str, torch.Tensor]]:
    """The uninterrupted run: the full state at steps 2 and 4."""
    torch.set_num_threads(1)
    stores: list[CommitStore] = [MemoryCommitStore() for _ in range(WORLD)]
    return dict(run_world(WORLD, _train, stores, 4)[0])


def _check_restore(
    survivors: Sequence[CommitStore], step: int, want: dict[str, torch.Tensor], where: str
) -> None:
    for got_step, state, full in run_world(len(survivors), _restore, list(survivors), timeout=60):
        assert got_step == step and state == {"step": step}, (where, got_step)
        assert full.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(full[k], v), (where, k)


@pytest.mark.parametrize("point", POINTS)
def test_a_rank_stopped_at_any_point_of_the_commit(
    point: str, trained: dict[int, dict[str, torch.Tensor]]
) -> None:
    for stopped in range(WORLD):
        inner = [MemoryCommitStore() for _ in range(WORLD)]
        stores: list[CommitStore] = [
            StoppingStore(s, 4 if r == stopped else None, point) for r, s in enumerate(inner)
        ]
        with pytest.raises(RankFailedError) as info:
            run_world(WORLD, _train, stores, 4, timeout=60)
        assert isinstance(info.value.__cause__, Stopped), info.value
        survivors = [s for r, s in enumerate(inner) if r != stopped]  # its memory went with it
        step = _newest_complete(survivors)
        if point == "before own piece":
            assert step == 2  # the stopped rank's piece of step 4 exists nowhere
        if point == "after dropping older":
            assert step == 4  # every rank passed the barrier: step 4 was committed, never lost
        _check_restore(survivors, step, trained[step], f"rank {stopped} stopped {point}")


@pytest.mark.parametrize("point", ["own piece half written", *POINTS])
def test_disk_stores_survive_a_rank_stopped_at_any_point(
    point: str, trained: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Node-local disk stores: the stopped rank's store outlives it (the worker restarts on its node),
    so every rank comes back; the restore takes the newest complete commit, ignoring a half-written
    temporary file."""
    for stopped in range(WORLD):
        dirs = [tmp_path / f"s{stopped}" / f"rank{r}" for r in range(WORLD)]
        stores: list[CommitStore] = [
            StoppingStore(DiskCommitStore(d), 4 if r == stopped else None, point) for r, d in enumerate(dirs)
        ]
        with pytest.raises(RankFailedError) as info:
            run_world(WORLD, _train, stores, 4, timeout=60)
        assert isinstance(info.value.__cause__, Stopped), info.value
        restarted = [DiskCommitStore(d) for d in dirs]
        step = _newest_complete(restarted)
        if point in ("before own piece", "own piece half written"):
            assert step == 2
        if point == "after dropping older":
            assert step == 4
        _check_restore(restarted, step, trained[step], f"rank {stopped} stopped {point} (disk)")


def _held_after_step(step: int) -> list[MemoryCommitStore]:
    stores = [MemoryCommitStore() for _ in range(WORLD)]
    run_world(WORLD, _train, stores, step)
    return stores


def test_recovery_with_each_rank_piece_of_the_newest_commit_missing_in_turn(
    trained: dict[int, dict[str, torch.Tensor]],
) -> None:
    """Step 2 complete everywhere; step 4 held for every rank but one (own piece and ring copy both
    gone): the restore must take step 2, whichever rank's piece is missing."""
    older, newer = _held_after_step(2), _held_after_step(4)
    for missing in range(WORLD):
        stores = []
        for r in range(WORLD):
            s = MemoryCommitStore()
            for k in older[r].keys():
                s.put(older[r].get(k))
            for k in newer[r].keys():
                if k.rank != missing:
                    s.put(newer[r].get(k))
            stores.append(s)
        assert _newest_complete(stores) == 2
        _check_restore(stores, 2, trained[2], f"rank {missing}'s piece of step 4 missing")
    # and with every piece held, step 4 is taken
    _check_restore([copy.copy(s) for s in newer], 4, trained[4], "nothing missing")
