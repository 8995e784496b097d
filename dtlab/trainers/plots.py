"""``loss.png``: training and eval loss against step and against bytes sent, for one run or several.

Read from each run's ``metrics.jsonl`` (every step's training loss, the records' ``losses``, and every
evaluation), so a run's own
``loss.png`` and ``dtlab plot RUN_DIR [RUN_DIR...]`` draw the same curves. Bytes sent are the largest
rank's cumulative bytes at each logged step (``bytes_sent_per_rank``); an evaluation's bytes are
interpolated between the logged steps around it. Drawn with matplotlib's object API (no pyplot, no
global state), so in-memory ranks (threads) may plot.
"""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.checkpoint.safe_files import write_output
from dtlab.errors import ConfigError

__all__ = ["Curves", "plot_runs", "read_curves", "write_loss_png"]


@dataclass
class Curves:
    """One run's curves: ``(step, value)`` pairs and the largest rank's MB sent at each logged step."""

    name: str
    train: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)
    sent_mb: list[tuple[int, float]] = field(default_factory=list)

    def mb_at(self, step: int) -> float | None:
        """MB sent by ``step``: linear between the logged steps around it; before the first logged
        step, continued back along the first two (bytes per step are steady), never below 0; None
        past the last logged step."""
        pts = self.sent_mb
        if len(pts) >= 2 and step < pts[0][0]:
            (s0, b0), (s1, b1) = pts[0], pts[1]
            return max(0.0, b0 - (b1 - b0) * (s0 - step) / max(1, s1 - s0))
        for (s0, b0), (s1, b1) in itertools.pairwise(pts):
            if s0 <= step <= s1:
                return b0 + (b1 - b0) * (step - s0) / max(1, s1 - s0)
        return pts[-1][1] if pts and pts[-1][0] == step else None


def _label(run_dir: Path) -> str:
    resolved = run_dir.resolve()
    return resolved.name if resolved.name else str(resolved)


def read_curves(run_dir: str | Path) -> Curves:
    """The curves in ``run_dir/metrics.jsonl``; a step logged twice (a resume that went back) keeps the
    later value."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} holds no metrics.jsonl; give a run directory (e.g. runs/latest)")
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    sent: dict[int, float] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec: Any = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: the others still count
            step = rec.get("step") if isinstance(rec, dict) else None
            if not isinstance(step, int):
                continue
            if isinstance(rec.get("loss"), int | float):
                train[step] = float(rec["loss"])
            for pair in rec.get("losses") or []:  # every step's loss since the previous record
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int):
                    train[pair[0]] = float(pair[1])
            if isinstance(rec.get("eval_loss"), int | float):
                evals[step] = float(rec["eval_loss"])
            per_rank = rec.get("bytes_sent_per_rank")
            if isinstance(per_rank, list) and per_rank:
                sent[step] = max(per_rank) / 1e6
    return Curves(_label(Path(run_dir)), sorted(train.items()), sorted(evals.items()), sorted(sent.items()))


def plot_runs(runs: list[Curves], out: str | Path, title: str | None = None) -> Path:
    """Two panels, one colour per run: loss against step, and against MB sent (largest rank);
    training loss a line, eval loss dashed with markers."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    by_step, by_bytes = fig.subplots(1, 2)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for curves, colour in zip(runs, colours, strict=True):
        tag = f"{curves.name}: " if len(runs) > 1 else ""
        if curves.train:
            steps, losses = zip(*curves.train, strict=True)
            by_step.plot(steps, losses, color=colour, label=f"{tag}training loss")
            pts = [(curves.mb_at(s), v) for s, v in curves.train]
            pts = [(b, v) for b, v in pts if b is not None]
            if pts:
                mb, vals = zip(*pts, strict=True)
                by_bytes.plot(mb, vals, color=colour, label=f"{tag}training loss")
        if curves.eval:
            steps, losses = zip(*curves.eval, strict=True)
            by_step.plot(steps, losses, "o--", color=colour, label=f"{tag}eval loss", markersize=4)
            pts = [(curves.mb_at(s), v) for s, v in curves.eval]
            pts = [(b, v) for b, v in pts if b is not None]
            if pts:
                mb, vals = zip(*pts, strict=True)
                by_bytes.plot(mb, vals, "o--", color=colour, label=f"{tag}eval loss", markersize=4)
    by_step.set(xlabel="step", ylabel="loss", title="loss against step")
    by_bytes.set(xlabel="MB sent (largest rank, cumulative)", ylabel="loss", title="loss against bytes sent")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.86 if title else 0.92, wspace=0.18)
    out = Path(out)
    image = io.BytesIO()
    fig.savefig(image, format=out.suffix.lstrip(".") or "png")
    write_output(out, image.getvalue(), str(out))
    return out


def write_loss_png(run_dir: Path, title: str | None = None) -> Path | None:
    """``run_dir/loss.png`` from its metrics; None when matplotlib is not installed or nothing was
    logged (a run stopped before its first logged step)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    curves = read_curves(run_dir)
    if not (curves.train or curves.eval):
        return None
    return plot_runs([curves], run_dir / "loss.png", title=title)
