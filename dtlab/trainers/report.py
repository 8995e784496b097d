"""What the trainer logs each N steps and prints at the end (numbers only; never NaN)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from dtlab.checkpoint.safe_files import replace_file
from dtlab.core.plan import RunPlan
from dtlab.models.base import ModelStrategy
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.optimizers.grad_scaler import DynamicLossScaler
from dtlab.trainers.construction import Construction
from dtlab.trainers.guard import NonFiniteGuard
from dtlab.trainers.metrics import clean
from dtlab.trainers.run_view import Progress, RunCore
from dtlab.trainers.scheduler import LRSchedulerLike
from dtlab.trainers.tasks import Task

if TYPE_CHECKING:
    from dtlab.trainers.progress import ProgressBar
    from dtlab.trainers.result import TrainResult

__all__ = [
    "ReportRun",
    "format_record",
    "header",
    "log_skipped",
    "memory_report",
    "print_tables",
    "profile_table",
    "step_record",
    "summary_rows",
    "summary_table",
    "write_profile",
]


class ReportRun(RunCore, Progress, Protocol):
    """What the records, console lines and summary read of a run (a Trainer is one); read only."""

    @property
    def plan(self) -> RunPlan: ...
    @property
    def task(self) -> Task: ...
    @property
    def num_parameters(self) -> int: ...
    @property
    def construction(self) -> Construction: ...
    @property
    def optimizer(self) -> OptimizerStrategy: ...
    @property
    def scheduler(self) -> LRSchedulerLike: ...
    @property
    def guard(self) -> NonFiniteGuard: ...
    @property
    def scaler(self) -> DynamicLossScaler | None: ...
    @property
    def overflow_steps(self) -> list[int]: ...
    @property
    def start_step(self) -> int: ...
    @property
    def run_dir(self) -> Path | None: ...


def memory_report(model: ModelStrategy, optimizer: OptimizerStrategy) -> dict[str, int]:
    """Bytes this rank holds (parameters, gradients, optimizer state, ...), from the strategies."""
    report = dict(model.memory_report())
    opt_report = getattr(optimizer, "memory_report", None)
    if callable(opt_report):
        report.update({k: v for k, v in opt_report().items() if v})
    return {k: int(v) for k, v in report.items()}


def _numbers(stats: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def step_record(
    trainer: ReportRun,
    window: dict[str, float],
    loss: float | None,
    norm: float | None,
    recent: list[tuple[int, float]] | None = None,
) -> dict[str, Any]:
    """Collective (all ranks call it at the same steps): gathers bytes and memory of every rank.
    ``recent``: the ``(step, loss)`` of every step since the last record (``losses``), for curves."""
    b = trainer.backend
    now = time.perf_counter()
    steps = max(1.0, window["steps"])
    dt = (now - window["t"]) / steps
    comm = (b.stats.seconds - window["comm"]) / steps
    mine = {"bytes_sent": b.stats.bytes_sent, "memory": memory_report(trainer.model, trainer.optimizer)}
    everyone = b.all_gather_object(mine)
    g = trainer.config.data.global_batch_size
    rec: dict[str, Any] = {
        "step": trainer.step,
        "loss": loss,
        "lr": float(trainer.scheduler.get_last_lr()[0]),
        "grad_norm": norm,
        "step_time_s": dt,
        "samples_per_s": g / dt if dt > 0 else None,
        "tokens_per_s": g * trainer.task.tokens_per_sample / dt if dt > 0 else None,
        "compute_s": max(0.0, dt - comm),
        "comm_s": comm,
        "bytes_sent_per_rank": [e["bytes_sent"] for e in everyone],
        "memory_per_rank": [e["memory"] for e in everyone],
        "skipped_steps": trainer.guard.skipped,
        "losses": [[s, v] for s, v in recent or []],
    }
    if trainer.config.compression.algorithm != "none":
        # the compression optimizer keeps the statistics of the step it just applied
        stats = (
            getattr(trainer.optimizer, "statistics", None) or trainer.model.gradient_reducer.step_statistics()
        )
        rec["compression"] = _numbers(stats)
        if "variant" in stats:  # Ok-Topk under reduce-scatter semantics: say which algorithm ran
            rec["compression"]["variant"] = stats["variant"]
        if "warmup" in stats:  # a dense warm-up step: say so, and for how many steps
            rec["compression"]["warmup"] = stats["warmup"]
    return rec


def _compression_variant(trainer: ReportRun) -> str | None:
    if trainer.config.compression.algorithm == "none":
        return None
    stats = getattr(trainer.optimizer, "statistics", None) or trainer.model.gradient_reducer.step_statistics()
    variant = stats.get("variant") if isinstance(stats, dict) else None
    return variant if isinstance(variant, str) else None


def _mesh(trainer: ReportRun) -> str | None:
    """``pp 2 x dp 1 x tp 2 (hybrid)`` for a model-parallel run; None otherwise (the row is left out)."""
    mesh = getattr(trainer.model, "mesh", None)
    if mesh is None:
        return None
    return " x ".join(f"{a} {n}" for a, n in mesh.shape.items()) + f" ({trainer.model.strategy_name})"


def summary_rows(trainer: ReportRun, result: TrainResult, seconds: float, sent0: int) -> dict[str, Any]:
    c = trainer.config
    steps_run = result.final_step - result.start_step
    samples = steps_run * c.data.global_batch_size
    prof = result.profile
    mem = memory_report(trainer.model, trainer.optimizer)
    rows: dict[str, Any] = {
        "task": trainer.task.name,
        "strategy": f"{c.strategy.model} model / {c.strategy.optimizer_name} optimizer"
        + (
            ""
            if c.compression.algorithm == "none"
            else f" / {c.compression.algorithm} @ {c.compression.density}"
        ),
        "compression variant": _compression_variant(trainer),
        "mesh": _mesh(trainer),
        "backend": f"{trainer.backend.name} x {trainer.backend.world_size}",
        "plan": _plan(trainer),
        "steps": f"{result.start_step} -> {result.final_step}"
        + (" (stopped early)" if result.stopped_early else ""),
        "loss first -> last": (
            f"{result.losses[0][1]:.4f} -> {result.losses[-1][1]:.4f}" if result.losses else "no step applied"
        ),
        "eval loss (last)": f"{result.evals[-1][1]['eval_loss']:.4f}" if result.evals else None,
        "eval accuracy (last)": _percent(result.evals[-1][1].get("eval_accuracy")) if result.evals else None,
        "skipped non-finite steps": len(result.skipped_steps),
        "wall time s": seconds,
        "samples/s": samples / seconds if seconds > 0 else None,
        "tokens/s": (  # a task without tokens (one target per sample): samples/s alone, as the step lines
            samples * trainer.task.tokens_per_sample / seconds
            if seconds > 0 and trainer.task.tokens_per_sample > 1
            else None
        ),
        "comm share of step time": _percent(prof["comm_seconds"] / prof["wall_seconds"])
        if prof["wall_seconds"]
        else None,
        # the figure of the last step line: the largest rank's bytes since the backend started
        "sent MB/rank (largest rank)": _last_sent_mb(trainer, sent0),
        "memory (rank 0) MB": sum(mem.values()) / 1e6,
        "checkpoint": result.checkpoint,
        "run directory": None if trainer.run_dir is None else str(trainer.run_dir),
    }
    return rows


def _percent(fraction: float | None) -> str | None:
    return None if fraction is None else f"{100 * fraction:.1f}%"


def _last_sent_mb(trainer: ReportRun, sent0: int) -> str:
    """MB sent as the last step line says it (``format_record``): the largest rank, cumulative."""
    for rec in reversed(trainer.metrics.records):
        sent = rec.get("bytes_sent_per_rank")
        if sent:
            return f"{max(sent) / 1e6:.1f}"
    return f"{(trainer.backend.stats.bytes_sent - sent0) / 1e6:.1f}"  # nothing logged: this rank's


def _plan(trainer: ReportRun) -> str:
    """Precision, accumulation, compression and elastic commits, as the config sets them."""
    c = trainer.config
    comp: str = c.compression.algorithm
    if comp != "none":
        comp += f" @ {c.compression.density}" if comp not in ("fp16", "bf16", "qsgd", "powersgd") else ""
        warm = c.compression.dense_warmup_steps
        comp += f" after {warm} dense steps" if warm else ""
    elastic = f"commit every {c.elastic.commit_every}" if c.elastic.commit_every else "off"
    micro = c.data.global_batch_size // max(1, trainer.dp.world_size * c.data.accumulation_steps)
    batches = f"accumulation {c.data.accumulation_steps} x micro-batch {micro}"
    if c.parallel.pp > 1:  # the pipeline splits each dp rank's batch (accumulation_steps is 1 there)
        m = c.parallel.micro_batches or c.parallel.pp
        batches = f"pipeline {c.parallel.schedule}: {m} micro-batches x {micro // m}"
    return f"precision {c.train.precision} | {batches} | compression {comp} | elastic {elastic}"


def format_record(rec: dict[str, Any]) -> str:
    """One console line for a logged record."""
    parts = [f"step {rec['step']:>5}"]
    if "loss" in rec:
        parts.append(f"loss {rec['loss']:.4f}")
    parts.append(f"lr {rec.get('lr', 0.0):.2e}")
    if "tokens_per_s" in rec and rec["tokens_per_s"] != rec.get("samples_per_s"):
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    elif "samples_per_s" in rec:
        parts.append(f"{rec['samples_per_s']:,.0f} samples/s")
    if rec.get("step_time_s"):
        parts.append(f"comm {100 * rec.get('comm_s', 0.0) / rec['step_time_s']:.0f}%")
    sent = rec.get("bytes_sent_per_rank")
    if sent:
        parts.append(f"sent {max(sent) / 1e6:.1f} MB/rank")
    comp = rec.get("compression", {})
    if "density" in comp:
        parts.append(f"density {comp['density']:.4f}")
    if "compression_ratio" in comp:
        parts.append(f"ratio {comp['compression_ratio']:.0f}x")
    if "warmup" in comp:
        parts.append(f"dense warm-up ({comp['dense_warmup_steps']:.0f} steps)")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    return " | ".join(parts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def summary_table(rows: dict[str, Any], title: str = "summary") -> Table:
    """Two columns (what, value); rows whose value is ``None`` are left out."""
    table = Table(title=title, title_justify="left", show_header=False, box=box.SIMPLE)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for k, v in rows.items():
        if v is not None:
            table.add_row(k, _fmt(v))
    return table


def profile_table(profile: dict[str, Any]) -> Table:
    """Where step time goes (``Profiler.summary()``): each phase's seconds and share, largest first."""
    table = Table(box=box.SIMPLE_HEAD, show_footer=True)
    table.add_column("where step time goes", footer="total", no_wrap=True)
    table.add_column("seconds", justify="right", footer=f"{profile['wall_seconds']:.3f}")
    table.add_column("share", justify="right", footer="100.0%")
    for name, row in sorted(profile["phases"].items(), key=lambda kv: -kv[1]["seconds"]):
        table.add_row(name, f"{row['seconds']:.3f}", f"{100 * row['fraction']:.1f}%")
    return table


def print_tables(*tables: Table, file: TextIO | None = None) -> None:
    """Print with ``rich``: styled on a terminal, plain text (no escape codes) anywhere else."""
    console = Console(file=file or sys.stdout, highlight=False)
    for table in tables:
        console.print(table)


def log_skipped(self: ReportRun, bar: ProgressBar) -> None:
    """A skipped step gets its own metrics record and console line at once (rank 0)."""
    g = self.guard
    if self.scaler is not None and self.overflow_steps and self.overflow_steps[-1] == self.step:
        text = f"fp16 gradients overflowed on some rank: loss scale lowered to {self.scaler.scale:g}"
        self.metrics.log({"step": self.step, "skipped": text, "loss_scale": self.scaler.scale})
        if self.is_main and self.config.logging.progress:
            bar.print_line(f"step {self.step:>5} | skipped on every rank: {text}")
        return
    self.metrics.log(
        {"step": self.step, "skipped": "non-finite loss or gradient", "skipped_steps": g.skipped}
    )
    if self.is_main and self.config.logging.progress:
        bar.print_line(
            f"step {self.step:>5} | skipped on every rank: non-finite loss or gradient on some rank "
            f"({g.skipped} skipped, {g.in_row} in a row; train.max_nonfinite_steps={g.max_in_row})"
        )


def header(self: ReportRun) -> str:
    """The first console line of a run: the task, the strategies and mesh, the backend, the plan."""
    c, t = self.config, self.task
    what = f"{t.name} ({self.num_parameters:,} parameters)"
    strategy = f"{c.strategy.model}/{c.strategy.optimizer_name}"
    shape = self.plan.mesh_shape  # the run plan, built once by the Trainer
    mesh = " x ".join(f"{a}{n}" for a, n in shape.items() if n > 1 or a == "dp")
    start = f"resumed at step {self.start_step}, " if self.start_step else ""
    run = f" | run {self.run_dir}" if self.run_dir is not None else ""
    return (
        f"dtlab train: {what} | {strategy} on mesh {mesh} | {self.backend.name} x "
        f"{self.backend.world_size} | {self.construction.describe()} | {_plan(self)} | {start}"
        f"{c.train.steps} steps x "
        f"{c.data.global_batch_size} samples ({len(t.train_data):,} train / {len(t.eval_data):,} eval){run}"
    )


def write_profile(self: ReportRun, result: TrainResult) -> None:
    """``profile.json`` and ``loss.png`` in the run directory (rank 0): the profile and the summary of
    ``result``, the loss curves of its metrics (``logging.plot``)."""
    run_dir = self.run_dir
    if run_dir is not None and self.is_main:
        path = run_dir / "profile.json"
        text = json.dumps(clean({"profile": result.profile, "summary": result.summary}), indent=1)
        replace_file(path, text.encode())  # a link planted at profile.json is replaced, not written through
        if self.config.logging.plot:
            from dtlab.trainers.plots import write_loss_png

            what = f"{self.task.name}: {self.config.strategy.model}, {self.backend.world_size} ranks"
            write_loss_png(run_dir, title=what)
