"""Resuming a :class:`~dtlab.trainers.Trainer`: which checkpoint (chosen once, on rank 0, and the same
on every rank), what is restored from it, and which step directories the run may later prune.

``checkpoint.resume=true`` takes the checkpoint ``dtlab.checkpoint.resume.find_resume_checkpoint``
chooses in ``checkpoint.dir`` (a fresh start when nothing was saved there); a path takes that step
directory exactly, or chooses the same way inside a checkpoint root.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint
from dtlab.checkpoint.agree import agree
from dtlab.checkpoint.files import META, list_step_dirs
from dtlab.checkpoint.load import LoadedCheckpoint
from dtlab.checkpoint.lock import LockOwner
from dtlab.checkpoint.resume import Check, find_resume_checkpoint
from dtlab.config import TrainConfig
from dtlab.errors import CheckpointError, DtlabError
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.trainers.build import optimizer_record, plain_value
from dtlab.trainers.metrics import MetricsCollector
from dtlab.trainers.ownership import another_run
from dtlab.trainers.rank_draws import RankDraws
from dtlab.trainers.run_view import RunCore
from dtlab.trainers.saved_state import Resumable, check_saved_state
from dtlab.trainers.scheduler import (
    LRSchedulerLike,
    length_changes,
    load_scheduler_state,
    scheduler_base_rates,
    set_scheduler_rates,
)
from dtlab.trainers.state import restore_rng

__all__ = [
    "Restorable",
    "Resumed",
    "choose_checkpoint",
    "foreign_steps_note",
    "optimizer_record",
    "owned_steps",
    "report_resume",
    "restore",
    "restore_agreed",
]


class Restorable(Resumable, RunCore, Protocol):
    """What a checkpoint is restored into (a Trainer is one): the trainer-level state, the model and
    optimizer strategies, on this rank of ``backend``, as ``config`` asks."""

    @property
    def optimizer(self) -> OptimizerStrategy: ...
    @property
    def draws(self) -> RankDraws: ...


@dataclass
class Resumed:
    checkpoint: LoadedCheckpoint | None
    notes: list[str] = field(default_factory=list)


def _choose_on_rank0(
    config: TrainConfig, previous: LockOwner | None, check: Check | None
) -> tuple[LoadedCheckpoint | None, list[str], str | None]:
    c = config.checkpoint
    where = Path(str(c.dir if c.resume is True else c.resume))
    try:
        if c.resume is not True and (where / META).is_file():
            ckpt = read_checkpoint(where, allow_outside=c.allow_outside_links)  # exactly: no fallback
            if check is not None:
                check(ckpt)
            return ckpt, [], None
        point = find_resume_checkpoint(
            where, strict=c.strict_resume, allow_outside=c.allow_outside_links, check=check
        )
        if point.checkpoint is None and c.resume is not True:
            what = "does not exist" if not where.exists() else "holds no checkpoint"
            return None, [], f"checkpoint.resume={str(where)!r} {what}"
        if point.checkpoint is None:  # resume=true: a first run, or a typo in checkpoint.dir
            if not where.is_dir():
                what = "it does not exist"
            elif not any(d.name.startswith("step_") for d in where.iterdir()):
                what = "it holds no step directory"
            else:
                what = "no step directory verifies there"
            if c.strict_resume:
                return (
                    None,
                    [],
                    (
                        f"checkpoint.resume=true: no checkpoint in {str(where)!r} ({what}); "
                        "checkpoint.strict_resume=true refuses to start at step 0: check checkpoint.dir, "
                        "or drop strict_resume for a run that may start fresh"
                    ),
                )
            return None, [*point.notes, f"no checkpoint in {str(where)!r} ({what}): starting at step 0"], None
        other = None if point.checkpoint is None else another_run(config, point.checkpoint, previous)
        if other is not None and c.strict_resume:
            return None, [], f"{other}: checkpoint.strict_resume=true refuses another run's checkpoint"
        if other is not None:
            point.notes.append(f"{other}: resuming from it anyway (checkpoint.strict_resume=true refuses)")
        return point.checkpoint, point.notes, None
    except CheckpointError as exc:
        return None, [], str(exc)


def choose_checkpoint(
    config: TrainConfig,
    backend: CommunicationBackend,
    previous: LockOwner | None = None,
    check: Check | None = None,
) -> Resumed:
    """Collective: rank 0 chooses (verifying candidates completely, ``check`` included, streaming every
    file without holding it), every rank reads the choice's ``meta.json`` and gets it lazily: a rank
    verifies each file it reads a tensor of when it first does (a file changed since is refused then,
    in :func:`restore_agreed`), and never opens the others. A rank that cannot read is named to every
    rank at once (no rank is left waiting in a collective while another has given up). ``previous``:
    the owner of the stale lock this run took over on ``checkpoint.dir`` (rank 0)."""
    c = config.checkpoint
    if not (c.dir if c.resume is True else c.resume):
        raise CheckpointError("checkpoint.resume=true needs checkpoint.dir (or give resume a path)")
    mine: LoadedCheckpoint | None = None
    msg = None
    if backend.rank == 0:
        try:
            mine, notes, error = _choose_on_rank0(config, previous, check)
        except Exception as exc:  # anything rank 0 meets is told to every rank, then raised here
            mine, notes, error = None, [], f"{type(exc).__name__} while choosing: {exc}"
        msg = (None if mine is None else str(mine.path), notes, error)
    path, notes, error = backend.broadcast_object(msg, src=0)
    if error is not None:
        raise CheckpointError(error)
    if path is None:
        return Resumed(None, notes)
    problem = None
    if mine is None:  # rank 0 verified every file; this rank verifies those it reads, as it reads them
        try:
            mine = read_checkpoint(path, allow_outside=c.allow_outside_links, verify_all=False)
        except CheckpointError as exc:
            problem = str(exc)
    agree(backend, problem, f"reading the checkpoint {path}")
    if mine is None:  # not reached: agree() raised on every rank
        raise CheckpointError(f"{path} was not read")
    return Resumed(mine, notes)


def owned_steps(config: TrainConfig, ckpt: LoadedCheckpoint | None) -> set[str]:
    """Step directories in ``checkpoint.dir`` this run continues (the resumed one and older ones,
    when it resumed from inside ``checkpoint.dir``): with what it writes, the only ones it may prune
    or replace. Newer ones and those of a run it did not resume from are never deleted."""
    root = config.checkpoint.dir
    if ckpt is None or root is None or not Path(root).is_dir():
        return set()
    if ckpt.path.parent.resolve() != Path(root).resolve():
        return set()
    return {p.name for s, p in list_step_dirs(Path(root)) if s <= ckpt.step}


def foreign_steps_note(config: TrainConfig, owned: set[str]) -> str | None:
    """A note when ``checkpoint.dir`` holds step directories this run will not own."""
    root = config.checkpoint.dir
    if root is None or not Path(root).is_dir():
        return None
    others = [p.name for _, p in list_step_dirs(Path(root)) if p.name not in owned]
    if not others:
        return None
    return (
        f"checkpoint.dir={root!r} holds {len(others)} step director{'y' if len(others) == 1 else 'ies'} "
        f"this run does not continue ({', '.join(others[-3:])}{', ...' if len(others) > 3 else ''}): "
        "it keeps them (never pruned; one in the way of a save is renamed superseded-...), and "
        "'latest' will name this run's checkpoints"
        + (
            "; to continue from them instead, set checkpoint.resume=true"
            if not config.checkpoint.resume
            else ""
        )
    )


def _saved_optimizer(ckpt: LoadedCheckpoint) -> dict[str, Any] | None:
    rec = ckpt.meta.get("optimizer")
    if isinstance(rec, dict) and isinstance(rec.get("hyperparameters"), dict):
        return rec
    try:  # written before the record existed: rebuild it from the saved config
        return optimizer_record(TrainConfig.model_validate(ckpt.meta.get("config")))
    except (ValueError, TypeError, KeyError):  # a config this dtlab no longer reads: nothing to compare
        return None


def _optimizer_notes(config: TrainConfig, ckpt: LoadedCheckpoint) -> tuple[list[str], dict[str, Any]]:
    """Compare the saved optimizer with the config's: another class is a ``CheckpointError`` unless
    ``checkpoint.reset_optimizer``; returns notes and the hyperparameters the config changed."""
    saved, now = _saved_optimizer(ckpt), optimizer_record(config)
    if config.checkpoint.reset_optimizer:
        was = f" (the checkpoint's {saved['class']} state is not loaded)" if saved else ""
        return [f"checkpoint.reset_optimizer=true: the optimizer starts fresh as {now['class']}{was}"], {}
    if saved is None:
        return [
            f"{ckpt.path} does not record its optimizer: its state is loaded as {now['class']} unchecked"
        ], {}
    if saved["class"] != now["class"]:
        raise CheckpointError(
            f"{ckpt.path} was written with optimizer torch.optim.{saved['class']}, this run asks for "
            f"torch.optim.{now['class']} (optimizer.name={config.optimizer.name!r}): their states do not "
            "carry over; resume with the checkpoint's optimizer, or set checkpoint.reset_optimizer=true "
            "to start the optimizer fresh (parameters, data position and LR schedule are restored)"
        )
    old, new = saved["hyperparameters"], now["hyperparameters"]
    changed = {k: v for k, v in new.items() if plain_value(old.get(k)) != v}
    if not changed:
        return [], {}
    listed = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in changed.items())
    return [f"optimizer hyperparameters differ from the checkpoint's, the config's apply: {listed}"], changed


def _apply_config_hyperparameters(
    optimizer: OptimizerStrategy,
    sched: LRSchedulerLike,
    changed: dict[str, Any],
    fresh_base: list[float],
    saved_base: list[float],
) -> None:
    """After loading optimizer and scheduler state: the hyperparameters the config changed in every
    param group (unchanged ones keep the loaded values, which a scheduler may drive, e.g. OneCycleLR's
    beta1), and the learning rate rescaled by the scheduler's base rate built from this config over
    the saved one (``lr`` for the built-in schedules; ``max_lr / div_factor`` for OneCycleLR)."""
    groups = optimizer.optimizer.param_groups
    for i, (group, last) in enumerate(zip(groups, sched.get_last_lr(), strict=True)):
        for k, v in changed.items():
            if k != "lr" and k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        new = fresh_base[i] if i < len(fresh_base) else None
        old = saved_base[i] if i < len(saved_base) else None
        if new is None or old is None or not old or new == old:
            group["lr"] = last
            continue
        group["lr"] = last * (new / old)
        if "initial_lr" in group:
            group["initial_lr"] = new
    set_scheduler_rates(sched, fresh_base, [g["lr"] for g in groups])


def _saved_setting(ckpt: LoadedCheckpoint, section: str, key: str, default: Any = None) -> Any:
    """The saved config's ``section.key`` (``default`` where the section lacks it); ``None`` where the
    saved config is not of a config's shape (a checkpoint's ``meta.json`` is untrusted)."""
    config = ckpt.meta.get("config")
    part = config.get(section, {}) if isinstance(config, dict) else None
    return part.get(key, default) if isinstance(part, dict) else None


def _check_schedule_length(trainer: Restorable, ckpt: LoadedCheckpoint, saved: Any) -> None:
    """A torch scheduler's saved run length (``T_max``, ``total_steps``, ``total_iters``) that differs
    from the one built now (``train.steps`` changed): loading would keep the saved one, silently
    (CosineAnnealingLR climbing back, OneCycleLR stopping at it): refused, naming both and the fix."""
    if not isinstance(saved, dict):
        return
    changes = length_changes(trainer.scheduler.state_dict(), saved)
    if not changes:
        return
    was = _saved_setting(ckpt, "train", "steps")
    now = trainer.config.train.steps
    name = type(trainer.scheduler).__name__
    has = ", ".join(f"{k}={a!r}" for k, a, _ in changes)
    builds = ", ".join(f"{k}={b!r}" for k, _, b in changes)
    steps = f" (train.steps={was} when saved, {now} now)" if isinstance(was, int) and was != now else ""
    back = f"train.steps={was}" if isinstance(was, int) and was != now else "the saved length"
    pin = ", ".join(f"{k.rsplit('.', 1)[-1]}: {a!r}" for k, a, _ in changes)
    raise CheckpointError(
        f"{ckpt.path}: its {name} has {has}, this run builds {builds}{steps}; a torch scheduler's saved "
        "state keeps its length, so the schedule would not follow this run's (CosineAnnealingLR climbs "
        "back after it, OneCycleLR stops there), while the built-in schedules do: resume with "
        f"{back}, or continue the saved schedule as it was by building it with that length "
        f"(optimizer.torch_scheduler_args={{{pin}}}, or in your scheduler_factory) where the scheduler "
        "may step past it"
    )


def restore(trainer: Restorable, ckpt: LoadedCheckpoint) -> list[str]:
    """Load everything a checkpoint holds into ``trainer`` (parameters, optimizer unless
    ``checkpoint.reset_optimizer``, schedule, data position, guard and early-stopping counters, RNG
    states at the same world size); returns notes on what differs (optimizer hyperparameters)."""
    check_saved_state(trainer, ckpt.meta, ckpt.step, str(ckpt.path / META))
    t = ckpt.meta["trainer"]
    steps = trainer.config.train.steps
    if t["step"] > steps:
        raise CheckpointError(
            f"{ckpt.path} is of step {t['step']}, past train.steps={steps}: there is nothing left to "
            f"train; set train.steps above {t['step']} to continue it, or resume another checkpoint"
        )
    notes, changed = _optimizer_notes(trainer.config, ckpt)  # before anything is loaded: may refuse
    _check_schedule_length(trainer, ckpt, t["scheduler"])
    trainer.model.load_sharded_state_dict(ckpt.model)
    if ckpt.optim is not None and not trainer.config.checkpoint.reset_optimizer:
        trainer.optimizer.load_sharded_state_dict(ckpt.optim)
    fresh_base = scheduler_base_rates(trainer.scheduler.state_dict())  # built from this run's config
    saved_base = scheduler_base_rates(load_scheduler_state(trainer.scheduler, t["scheduler"]))
    _apply_config_hyperparameters(trainer.optimizer, trainer.scheduler, changed, fresh_base, saved_base)
    try:
        trainer.feed.load_state_dict(ckpt.meta["data_position"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from None
    trainer.guard.load_state_dict(t["guard"])
    if trainer.scaler is not None and t.get("loss_scaler"):
        trainer.scaler.load_state_dict(t["loss_scaler"])
    trainer.early.load_state_dict(t["early_stopping"])
    trainer.step = trainer.start_step = int(t["step"])
    # each rank's RNG (dropout) as saved, where the ranks of a tp group saved alike states: the same
    # world and tp (tp groups are blocks of tp consecutive ranks); else the launcher's seeding stays
    saved_tp = _saved_setting(ckpt, "parallel", "tp", 1)
    if ckpt.world_size == trainer.backend.world_size and saved_tp == trainer.config.parallel.tp:
        own = dict(ckpt.rank_states[trainer.backend.rank])  # this rank's file only is read
        restore_rng(own, trainer.backend.device)
        trainer.draws.load(own)
    return notes


def restore_agreed(trainer: Restorable, ckpt: LoadedCheckpoint) -> list[str]:
    """Collective :func:`restore`: a rank whose restore fails (a shard that does not fit its part of
    the model) is named on every rank at once, and every rank raises."""
    notes: list[str] = []
    problem = None
    try:
        notes = restore(trainer, ckpt)
    except DtlabError as exc:
        problem = str(exc)
    agree(trainer.backend, problem, f"restoring {ckpt.path}")
    return notes


def report_resume(
    metrics: MetricsCollector, resumed_from: str | None, notes: list[str], start_step: int
) -> None:
    """Rank 0 calls it: each note as a warning, a line naming the checkpoint taken (``resumed_from``,
    at ``start_step``), a metrics record; nothing when there is neither."""
    if not (resumed_from or notes):
        return
    log = logging.getLogger("dtlab.trainers")
    for note in notes:
        log.warning("dtlab: %s", note)
    if resumed_from:
        print(f"dtlab: resumed from {resumed_from} (step {start_step})", file=sys.stderr)
    record: dict[str, Any] = {"step": start_step, "resumed_from": resumed_from}
    if notes:
        record["resume_notes"] = notes
    metrics.log(record)
