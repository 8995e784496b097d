"""The training progress display on rank 0, with ``rich``.

On a terminal: a live bar (steps, loss, elapsed, remaining) with the metric lines printed above it.
Anywhere else (a pipe, a log file, a notebook's captured output): plain text lines only, never a
terminal escape code: the metric lines as they come and a progress line at most every
``plain_interval`` seconds. ``rich`` decides what a terminal is (``isatty``, ``TERM=dumb``,
``NO_COLOR``/``FORCE_COLOR``, ``TTY_COMPATIBLE``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["ProgressBar"]


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """``update(step, info)`` after each step, ``print_line(text)`` for a full line, ``close()`` at the end.

    ``initial`` is the step a resumed run starts at; the remaining time counts only the steps run here.
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        initial: int = 0,
        plain_interval: float = 30.0,
    ) -> None:
        self.total, self.enabled, self.initial = total, enabled, initial
        self.plain_interval = plain_interval
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        self.live = enabled and self.console.is_terminal
        self._t0 = time.perf_counter()
        self._last_plain = self._t0
        self._last_step = initial
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("<"),
                TimeRemainingColumn(),
                console=self.console,
                refresh_per_second=4,
            )
            self._task = self._progress.add_task("train", total=total, completed=initial, info="")
            self._progress.start()

    def update(self, step: int, info: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        self._last_step = step
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, info=info)
            return
        now = time.perf_counter()
        if force or step >= self.total or now - self._last_plain >= self.plain_interval:
            self._last_plain = now
            self.console.print(self._plain_line(step, info, now), markup=False)

    def _plain_line(self, step: int, info: str, now: float) -> str:
        elapsed = now - self._t0
        done = step - self.initial
        left = (self.total - step) * elapsed / done if done > 0 else None
        pct = 100.0 * step / max(1, self.total)
        eta = f", ~{_duration(left)} left" if left is not None and step < self.total else ""
        what = f" | {info}" if info else ""
        return f"progress {step}/{self.total} ({pct:.0f}%){what} | {_duration(elapsed)} elapsed{eta}"

    def print_line(self, text: str) -> None:
        """Print one full line (above the live bar on a terminal)."""
        if self.enabled:
            self.console.print(text, markup=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
