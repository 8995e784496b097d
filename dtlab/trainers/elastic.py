"""The Trainer's side of elastic training (config section ``elastic``).

``elastic.commit_every=N`` wraps the optimizer strategy in an
:class:`~dtlab.optimizers.elastic.ElasticOptimizer`; the Trainer restores the last commit at
construction (:func:`restore_commit`) and reports every step end (:func:`end_step`), so each commit
holds the step's shards and the trainer-level state (data position, LR schedule, counters) of the same
step. Where commits are held: the member given to the Trainer (the in-memory engine's), else a
node-local directory ``elastic.dir`` (required under torchrun, whose workers restart as new
processes), else this process's memory.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.init import detect_launcher
from dtlab.config import TrainConfig
from dtlab.errors import CheckpointError, ConfigError
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.optimizers.elastic import DiskCommitStore, ElasticMember, ElasticOptimizer, StaticMember
from dtlab.trainers.run_view import Progress
from dtlab.trainers.saved_state import Resumable, check_saved_state
from dtlab.trainers.scheduler import load_scheduler_state
from dtlab.trainers.state import rng_from_json, rng_to_json

__all__ = [
    "ElasticRestorable",
    "ElasticRun",
    "commit_on_stop",
    "end_step",
    "report_restore",
    "restore_commit",
    "wrap_elastic",
]


class ElasticRun(Progress, Protocol):
    """What the elastic helpers read of a run (a Trainer is one): its elastic optimizer (``None``
    without ``elastic.commit_every``), the step just finished, its metrics (written on rank 0) and the
    trainer-level state a commit holds."""

    @property
    def elastic(self) -> ElasticOptimizer | None: ...
    def resume_state(self) -> dict[str, Any]: ...
    def rank_state(self) -> dict[str, torch.Tensor]: ...
    @property
    def backend(self) -> CommunicationBackend: ...


class ElasticRestorable(Resumable, Protocol):
    """What a commit is restored into (a Trainer is one): the trainer-level state and this rank's RNG
    states (``rank_state()``'s, set back by ``load_rank_state``)."""

    def rank_state(self) -> dict[str, torch.Tensor]: ...
    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None: ...
    @property
    def backend(self) -> CommunicationBackend: ...


def wrap_elastic(
    config: TrainConfig, optimizer: OptimizerStrategy, member: ElasticMember | None
) -> ElasticOptimizer | None:
    """``optimizer`` wrapped for elastic training, or ``None`` when ``elastic.commit_every`` is 0."""
    e = config.elastic
    if not e.commit_every:
        if member is not None:
            raise ConfigError(
                "the Trainer was given an elastic member (run_elastic) but elastic.commit_every is 0; "
                "set elastic.commit_every to the steps between commits, e.g. --set elastic.commit_every=20"
            )
        return None
    if member is None:
        if e.dir is not None:
            member = StaticMember(DiskCommitStore(Path(e.dir)))
        elif detect_launcher().launcher == "torchrun":
            raise ConfigError(
                "elastic.commit_every is set under torchrun, whose workers restart as new processes "
                "after a membership change: the commits must outlive them. Set elastic.dir to a "
                "node-local directory (e.g. --set elastic.dir=/tmp/dtlab-elastic/<job>), one per node"
            )
        else:
            member = StaticMember()
    # torchrun places LOCAL_WORLD_SIZE consecutive ranks on each node: copies go to the next node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return ElasticOptimizer(optimizer, commit_every=e.commit_every, member=member, copy_to=max(1, per_node))


def restore_commit(opt: ElasticOptimizer | None, trainer: ElasticRestorable) -> bool:
    """Collective: load the last commit the members hold (parameters, optimizer and compression
    state through ``opt``; LR schedule, data position, counters, loss scale into ``trainer``; at the
    committed world size each rank's RNG states, so dropout goes on as it would have); ``False`` when
    there is none (or no ``opt``)."""
    if opt is None:
        return False
    commit = opt.restore()
    if commit is None:
        return False
    state = commit.state
    # the same commit on every rank: a crafted state fails alike everywhere, before anything is loaded
    check_saved_state(trainer, state, commit.key.step, f"the elastic commit of step {commit.key.step}")
    t = state["trainer"]
    load_scheduler_state(trainer.scheduler, t["scheduler"])
    for group, lr in zip(opt.optimizer.param_groups, trainer.scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    try:
        trainer.feed.load_state_dict(state["data_position"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the elastic commit of step {commit.key.step}: {exc}") from None
    trainer.guard.load_state_dict(t["guard"])
    trainer.early.load_state_dict(t["early_stopping"])
    if trainer.scaler is not None and t.get("loss_scaler"):
        trainer.scaler.load_state_dict(t["loss_scaler"])
    trainer.step = trainer.start_step = int(t["step"])
    own = opt.own_restored
    if own is not None:  # the committed world size: this rank's own commit
        b = trainer.backend
        where = f"the elastic commit of step {commit.key.step}"
        rng = rng_from_json(own.state.get("rank_rng"), trainer.rank_state(), b.rank, b.world_size, where)
        if rng is not None:
            trainer.load_rank_state(rng)
    return True


def _committed_state(trainer: ElasticRun) -> dict[str, Any]:
    """A commit's state: the trainer-level state and this rank's RNG states (rank-tagged)."""
    b = trainer.backend
    return {**trainer.resume_state(), "rank_rng": rng_to_json(trainer.rank_state(), b.rank, b.world_size)}


def end_step(trainer: ElasticRun) -> None:
    """After each step: commit when due (with the trainer-level state of this very step); rank 0
    logs an ``elastic_commit`` metrics record (seconds, bytes of its commit, bytes held)."""
    opt = trainer.elastic
    if opt is None:
        return
    count = opt.commit_count
    try:
        opt.end_step(trainer.step, lambda: _committed_state(trainer))
    finally:  # a planned membership change commits, then leaves the world by raising
        if opt.commit_count > count:
            _log_commit(trainer, opt)


def commit_on_stop(trainer: ElasticRun) -> None:
    """Every rank agreed to stop after this step (a signal: torchrun's SIGTERM when a node joins, a
    scheduler's preemption): commit it unless it was just committed, so the restart redoes nothing."""
    opt = trainer.elastic
    if opt is None or (opt.last_commit is not None and opt.last_commit.step == trainer.step):
        return
    opt.commit(trainer.step, _committed_state(trainer))
    _log_commit(trainer, opt)


def _log_commit(trainer: ElasticRun, opt: ElasticOptimizer) -> None:
    if trainer.is_main:
        record = {"seconds": opt.commit_seconds, "bytes": opt.commit_bytes}
        trainer.metrics.log(
            {"step": trainer.step, "elastic_commit": {**record, "held_bytes": opt.member.store.nbytes()}}
        )


def report_restore(trainer: ElasticRun) -> None:
    """Rank 0, after a restore: a line on stderr and an ``elastic`` metrics record (with the wall
    time, so a launcher-side measurement can line it up with the moment a rank was lost)."""
    opt = trainer.elastic
    if opt is None or opt.recovery is None or not trainer.is_main:
        return
    r = opt.recovery
    print(
        f"dtlab: elastic: restored the commit of step {r['step']} ({r['from_world_size']} ranks) on "
        f"{r['world_size']} ranks in {r['seconds']:.2f}s",
        file=sys.stderr,
    )
    trainer.metrics.log({"step": r["step"], "elastic": {**r, "unix_time": time.time()}})
