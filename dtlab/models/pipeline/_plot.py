"""``plot_schedule``: a pipeline schedule's timeline as a PNG (matplotlib, imported when called)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtlab.errors import ArgumentError
from dtlab.models.pipeline._schedules import Kind, PipelineSchedule, Timeline, build_schedule, simulate

__all__ = ["plot_schedule"]

#: each compute kind's colour and legend label
_STYLE = {
    Kind.F: ("#4C72B0", "forward (F)"),
    Kind.B: ("#55A868", "backward (B)"),
    Kind.I: ("#55A868", "input gradient (I)"),
    Kind.W: ("#DD8452", "weight gradient (W)"),
}


def plot_schedule(
    schedule: str | PipelineSchedule,
    p: int,
    m: int,
    path: str | Path,
    *,
    stages_per_rank: int = 1,
    costs: Mapping[Kind, float] | None = None,
    measured: Timeline | None = None,
    title: str | None = None,
) -> Path:
    """Write the timeline of ``schedule`` (a name or a built schedule) for ``p`` ranks and ``m``
    micro-batches to ``path`` (PNG). One row per rank; forwards blue, backwards (or input-gradients)
    green, weight-gradients orange, each labelled with its micro-batch (and stage when a rank holds
    several); later chunks are drawn lighter. The planned timeline comes from :func:`simulate` with
    ``costs`` seconds per kind (default F = 1, B = 2, I = W = 1, divided by the stages per rank, so
    timelines of one model compare across schedules). With ``measured`` (a timeline recorded by a run)
    the measured one is drawn below the planned one. Returns the path."""
    built = schedule
    if not isinstance(built, PipelineSchedule):
        built = build_schedule(built, p, m, stages_per_rank)
    if (built.p, built.m) != (p, m):
        raise ArgumentError(
            f"plot_schedule: the schedule was built for p={built.p}, m={built.m}, not p={p}, m={m}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = built.v
    default = {Kind.F: 1.0 / v, Kind.B: 2.0 / v, Kind.I: 1.0 / v, Kind.W: 1.0 / v}
    if bad := [k for k in (costs or {}) if k not in default]:  # a string 'F' or another kind: never read
        raise ArgumentError(f"plot_schedule: costs are keyed by Kind.F, Kind.B, Kind.I or Kind.W, got {bad}")
    planned = simulate(built, {**default, **(costs or {})})
    panels = [("planned", planned)] + ([("measured", measured)] if measured is not None else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.55 * p * len(panels) + 1.3), squeeze=False)
    for ax, (label, timeline) in zip(axes[:, 0], panels, strict=True):
        _draw(ax, built, timeline)
        span, idle = timeline.makespan, 100 * timeline.bubble()
        ax.set_title(f"{label}: makespan {span:.3g}, idle {idle:.1f}%", fontsize=9)
    _legend(axes[0, 0], built, planned)
    name = title or f"{built.name}  p={p}  m={m}" + (f"  v={built.v}" if built.v > 1 else "")
    fig.suptitle(name, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw(ax: Any, s: PipelineSchedule, timeline: Timeline) -> None:
    t0 = min((iv[0][1] for iv in timeline.intervals if iv), default=0.0)
    for r, intervals in enumerate(timeline.intervals):
        for a, start, end in intervals:
            alpha = 1.0 - 0.45 * (a.stage // s.p) / (s.v - 1) if s.v > 1 else 1.0  # later chunks lighter
            ax.broken_barh(
                [(start - t0, end - start)],
                (r - 0.4, 0.8),
                facecolors=_STYLE[a.kind][0],
                alpha=alpha,
                edgecolor="black",
                linewidth=0.4,
            )
            text = f"{a.micro}" if s.v == 1 else f"{a.micro}.{a.stage}"
            ax.text(
                start - t0 + (end - start) / 2, r, text, ha="center", va="center", fontsize=6, color="white"
            )
    ax.set_yticks(range(s.p))
    ax.set_yticklabels([f"rank {r}" for r in range(s.p)])
    ax.invert_yaxis()
    ax.set_xlabel("time")


def _legend(ax: Any, s: PipelineSchedule, timeline: Timeline) -> None:
    """What each colour is (the kinds this schedule runs), and what lighter means with several chunks."""
    from matplotlib.patches import Patch

    kinds = {a.kind for intervals in timeline.intervals for a, _, _ in intervals}
    handles = [
        Patch(facecolor=c, edgecolor="black", label=name) for k, (c, name) in _STYLE.items() if k in kinds
    ]
    if s.v > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", label="lighter: a later stage chunk"))
    label = "label: micro-batch" + (".stage" if s.v > 1 else "")
    handles.append(Patch(facecolor="none", edgecolor="none", label=label))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
