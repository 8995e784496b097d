"""``MetricsCollector``: one JSON object per line per logged step; never a NaN or infinity.

A value that is not a finite number (no sample yet, a skipped step) is left out of its record, so
every number in the file is real. ``json.dumps(..., allow_nan=False)`` enforces it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol, cast

from dtlab.checkpoint.safe_files import open_text
from dtlab.errors import check_path, check_switches

__all__ = ["MetricsCollector", "clean"]


def clean(value: Any) -> Any:
    """Drop non-finite floats and ``None`` (recursively); tensors and numpy scalars become numbers."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        out = {str(k): clean(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return str(value)


class RecordSink(Protocol):
    """Another destination for every record (TensorBoard, W&B, CSV: ``dtlab/trainers/sinks.py``)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsCollector:
    """Writes records to ``path`` (JSON Lines) when ``enabled`` (rank 0); keeps them in ``records``;
    passes each to every sink in ``sinks``."""

    def __init__(
        self,
        path: str | Path | None,
        enabled: bool = True,
        keep: bool = True,
        append: bool = False,
        sinks: Sequence[RecordSink] = (),
    ) -> None:
        if path is not None:
            check_path("MetricsCollector", "path", path, "the JSON Lines file to write (or None)")
        check_switches("MetricsCollector", enabled=enabled, keep=keep, append=append)
        self.path = Path(path) if path is not None else None
        self.enabled = enabled
        self.keep = keep
        self.sinks = list(sinks) if enabled else []
        self.records: list[dict[str, Any]] = []
        #: close() was called: nothing more is written (a Trainer's next fit() opens a new collector)
        self.closed = False
        self._file: IO[str] | None = None
        if self.path is not None and enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open_text(self.path, append, "remove it, or choose another logging.run_dir")

    def log(self, record: dict[str, Any]) -> dict[str, Any]:
        rec = clean(record)
        if self.keep:
            self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec, allow_nan=False) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.write(rec)
        return cast(dict[str, Any], rec)

    def close(self) -> None:
        self.closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
