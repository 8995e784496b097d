"""A dependency-free progress bar (one ``\\r`` line on stderr, rank 0) and the final summary table."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["ProgressBar", "summary_table"]


class ProgressBar:
    def __init__(
        self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._t0 = time.perf_counter()
        self._shown = False
        # redraw often on a terminal, rarely into a log file
        self.interval = 0.2 if getattr(self.stream, "isatty", lambda: False)() else 2.0

    def update(self, step: int, info: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.interval and step < self.total:
            return
        self._last = now
        frac = min(1.0, step / max(1, self.total))
        filled = int(self.width * frac)
        elapsed = now - self._t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {step}/{self.total} {info} {elapsed:.0f}s<{eta:.0f}s ")
        self.stream.flush()
        self._shown = True

    def print_line(self, text: str) -> None:
        """Print a full line above the bar (the bar is redrawn on the next update)."""
        if self.enabled:
            self.stream.write("\r\033[K" if self._shown else "")
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last = 0.0

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def summary_table(rows: dict[str, Any], title: str = "summary") -> str:
    width = max([len(k) for k in rows] + [len(title)])
    lines = [title, "-" * (width + 30)]
    lines += [f"{k:<{width}}  {_fmt(v)}" for k, v in rows.items() if v is not None]
    return "\n".join(lines)
