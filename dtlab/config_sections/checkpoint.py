"""The sections that keep a run's state to resume from: ``checkpoint`` (step directories on disk) and
``elastic`` (in-memory commits a lost rank is restored from)."""

from __future__ import annotations

from pydantic import Field, field_validator

from dtlab.config_sections.base import Section


class CheckpointConfig(Section):
    #: directory holding one sub-directory per saved step; ``None`` disables checkpoints
    dir: str | None = None
    #: save every N steps (and after the last step); 0: only at the end
    every: int = Field(default=0, ge=0)
    #: step directories kept in ``checkpoint.dir`` (older ones this run wrote are deleted)
    keep_last: int = Field(default=2, ge=1)
    #: resume from ``latest`` in ``checkpoint.dir``, or from an explicit step directory
    resume: bool | str = False
    #: a resume never falls back past a broken ``latest`` or a newest step that does not verify: a
    #: ``CheckpointError`` instead of a warning and the newest step directory that verifies
    strict_resume: bool = False
    #: resume with a fresh optimizer (no saved optimizer state, compression state included): needed to
    #: change ``optimizer.name`` on resume; parameters, data position and LR schedule are restored
    reset_optimizer: bool = False
    #: seconds after which another host's lock on ``dir``, not refreshed (its owner refreshes it every
    #: ``lock_stale_after / 4`` s, at most every 60 s), is taken over; a lock of a dead process on this
    #: host is taken over at once
    lock_stale_after: float = Field(default=600.0, gt=0)
    #: read step directories and files that are links resolving outside the checkpoint directory
    #: (refused by default: a checkpoint shared with you should not read your other files)
    allow_outside_links: bool = False

    @field_validator("dir", "resume")
    @classmethod
    def _not_empty(cls, v: str | bool | None) -> str | bool | None:
        if v == "":
            raise ValueError("an empty path; give a directory, or null (dir) / false (resume) to turn it off")
        return v


class ElasticConfig(Section):
    #: commit the model and optimizer shards, data position, LR schedule and compression state every
    #: N steps, with a copy on the ring neighbour, so a lost rank loses nothing committed and at most
    #: N steps are redone (docs/elastic.md); 0: off
    commit_every: int = Field(default=0, ge=0)
    #: where the commits are held: ``None`` in memory; a node-local directory under torchrun elastic
    #: (its workers restart as new processes), one per node
    dir: str | None = None
