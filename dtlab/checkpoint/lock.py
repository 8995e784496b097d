"""One run owns a checkpoint directory: the lock file ``<dir>/lock``.

The lock holds its owner (host, pid, run id, start time, the launcher's job id when there is one) as
JSON. It is created atomically (written under a temporary name, then hard-linked to ``lock``, which
fails when a lock exists: two runs starting together cannot both win, also on NFS), refreshed by its
owner every ``stale_after / 4`` seconds (at most every 60 s) while held, and removed by its owner
only. A lock that exists is

- **live**: the owner holds it; a second run is refused (:class:`CheckpointError` naming the owner);
- **stale**: its process is gone (same host: no such pid, or a pid reused by a younger process), it
  was not refreshed for ``stale_after`` seconds (another host), or it is this launcher job's own lock
  (torchrun restarting its workers): it is taken over, with a warning naming the old owner.

Nothing here deletes anything but the lock file it wrote (or the stale one it replaced).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dtlab.checkpoint.safe_files import read_inside
from dtlab.errors import CheckpointError

#: the largest lock file read (it holds a few fields)
_MAX_LOCK_BYTES = 1 << 16

__all__ = ["LOCK", "DirectoryLock", "LockOwner"]

LOCK = "lock"


@dataclass(frozen=True)
class LockOwner:
    host: str
    pid: int
    run_id: str
    #: seconds since the epoch
    started: float
    #: the launcher's job id (torchrun's ``TORCHELASTIC_RUN_ID``): workers it restarts take the lock over
    job: str | None = None
    #: run id of the checkpoint this run resumed from (set once it resumed)
    resumed_run: str | None = None

    @staticmethod
    def of_this_process(run_id: str) -> LockOwner:
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        return LockOwner(
            host=socket.gethostname(),
            pid=os.getpid(),
            run_id=run_id,
            started=time.time(),
            job=job if job and job != "none" else None,
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"run {self.run_id[:12]} (pid {self.pid} on host {self.host}, started {when})"


def _read(path: Path) -> tuple[LockOwner | None, str | None]:
    """The owner a lock file names, or ``(None, problem)`` when it cannot be read or parsed."""
    if not os.path.lexists(path):
        return None, None
    try:  # a lock file in a shared directory is untrusted: bounded, not followed through a link
        doc: Any = json.loads(read_inside(path, None, "the lock file", limit=_MAX_LOCK_BYTES))
        if not isinstance(doc, dict) or any(len(str(doc.get(k, ""))) > 4096 for k in doc):
            raise ValueError("not a lock file dtlab writes")
        return (
            LockOwner(
                host=str(doc["host"]),
                pid=int(doc["pid"]),
                run_id=str(doc["run_id"]),
                started=float(doc["started"]),
                job=None if doc.get("job") is None else str(doc["job"]),
                resumed_run=None if doc.get("resumed_run") is None else str(doc["resumed_run"]),
            ),
            None,
        )
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except RecursionError:
        return None, "its JSON is nested too deeply"


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; ``None`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(owner: LockOwner) -> bool:
    """Whether ``owner``'s process (on this host) still runs, and is not a younger one with its pid."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    start = _process_start(owner.pid)
    return start is None or start <= owner.started + 2.0  # 2 s: /proc's clock ticks and boot time


class DirectoryLock:
    """The lock of checkpoint directory ``root`` for the run ``owner`` (see the module docstring)."""

    def __init__(self, root: str | Path, owner: LockOwner, stale_after: float) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK
        self.owner = owner
        self.stale_after = stale_after
        self.held = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        #: directories ``acquire`` created (deepest last): removed on release when still empty
        self._made: list[Path] = []

    # ------------------------------------------------------------------ acquire
    def _create(self, owner: LockOwner) -> bool:
        """Atomically create the lock naming ``owner``; ``False`` when a lock exists."""
        tmp = self.root / f".tmp-lock-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(asdict(owner), indent=1) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def _stale(self, other: LockOwner) -> str | None:
        """Why ``other``'s lock is stale (the warning's reason), or ``None`` while it is live."""
        if other.run_id == self.owner.run_id:
            return "this run's own lock"
        if other.job is not None and other.job == self.owner.job:
            return f"a lock of this launcher job ({other.job}), whose workers were restarted"
        if other.host == self.owner.host:
            return None if _alive(other) else "its process is gone"
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return None
        if age > self.stale_after:
            return (
                f"another host's lock not refreshed for {age:.0f} s "
                f"(> checkpoint.lock_stale_after={self.stale_after:g} s)"
            )
        return None

    def _refusal(self, other: LockOwner) -> CheckpointError:
        return CheckpointError(
            f"checkpoint.dir={str(self.root)!r} is in use by {other.describe()}, which holds {self.path}: "
            "two runs saving into one directory destroy each other's checkpoints, so this run is refused "
            "before any work. Give it another checkpoint.dir, or stop that run first. A lock whose "
            "process is gone is taken over on its own (another host's once not refreshed for "
            f"checkpoint.lock_stale_after={self.stale_after:g} s); delete {self.path} only if you know "
            "that run is gone"
        )

    def acquire(self) -> tuple[list[str], LockOwner | None]:
        """Take the lock; returns warnings (a stale lock taken over) and the owner it took over from.

        A :class:`CheckpointError` while another run holds it."""
        missing, p = [], self.root
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        self.root.mkdir(parents=True, exist_ok=True)
        self._made = list(reversed(missing))
        notes: list[str] = []
        previous: LockOwner | None = None
        for _ in range(5):  # a lock released or taken over between our looks: look again
            if self._create(self.owner):
                self.held = True
                self._start_heartbeat()
                return notes, previous
            other, problem = _read(self.path)
            if other is None and problem is None:
                continue  # released meanwhile
            if other is None:
                try:
                    age = time.time() - self.path.stat().st_mtime
                except OSError:
                    continue
                if age < 10.0:  # being written by a run that has just started: its lock
                    raise CheckpointError(
                        f"checkpoint.dir={str(self.root)!r} has a lock being created by another run "
                        f"({self.path}): give this run another checkpoint.dir, or stop that run first"
                    )
                reason, what = f"it cannot be read ({problem})", f"the unreadable lock {self.path}"
            else:
                reason, what = self._stale(other), other.describe()  # type: ignore[assignment]
                if reason is None:
                    raise self._refusal(other)
            aside = self.root / f".tmp-stale-lock-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            moved, _ = _read(aside)
            if other is not None and moved is not None and moved.run_id != other.run_id:
                # another run took the stale lock over between our read and our rename: give it back
                try:
                    os.link(aside, self.path)
                finally:
                    aside.unlink()
                raise self._refusal(moved)
            aside.unlink()
            previous = other
            if reason != "this run's own lock":
                notes.append(f"took over the lock of {what} in {self.root}: {reason}")
        raise CheckpointError(f"could not take the lock {self.path}: it changed hands five times; retry")

    # ------------------------------------------------------------------ while held
    def _start_heartbeat(self) -> None:
        interval = min(60.0, self.stale_after / 4)
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval):
                self.refresh()

        self._beat = threading.Thread(target=beat, name="dtlab-checkpoint-lock", daemon=True)
        self._beat.start()

    def refresh(self) -> None:
        """Show the lock is held (its modification time is what another host judges staleness by)."""
        try:
            os.utime(self.path)
        except OSError:
            pass

    def update(self, **changes: Any) -> None:
        """Rewrite the owner record (e.g. ``resumed_run`` once resumed); the lock stays held throughout."""
        if not self.held:
            return
        fields = asdict(self.owner)
        fields.update(changes)
        self.owner = LockOwner(**fields)
        tmp = self.root / f".tmp-lock-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(fields, indent=1) + "\n")
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the lock if it is still this run's (never another run's that took it over)."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        self._beat = None
        if not self.held:
            return
        self.held = False
        current, _ = _read(self.path)
        if current is not None and current.run_id == self.owner.run_id:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        for d in reversed(self._made):  # a run that saved nothing leaves no directory it made
            try:
                d.rmdir()
            except OSError:
                break
        self._made = []
