"""Where metrics records go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, a CSV file.

Each sink takes every record :class:`~dtlab.trainers.metrics.MetricsCollector` writes (already
cleaned: numbers are finite) and maps the same quantities to its own names:

| record field | TensorBoard / W&B tag | CSV column |
|---|---|---|
| ``loss`` (TensorBoard: every step's, from ``losses``) | ``train/loss`` | ``loss`` |
| ``lr``, ``grad_norm`` | ``train/lr``, ``train/grad_norm`` | same names |
| ``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``comm_s`` | ``throughput/...`` | same names |
| ``bytes_sent_per_rank`` (largest rank, cumulative) | ``comm/bytes_sent_MB`` | ``bytes_sent_MB`` |
| ``memory_per_rank`` (rank 0, all kinds) | ``memory/rank0_MB`` | ``memory_rank0_MB`` |
| ``eval_loss``, ``eval_accuracy`` | ``eval/loss``, ``eval/accuracy`` | same names |
| ``compression`` numbers | ``compression/<name>`` | - |

The packages are optional (``pip install tensorboard``, ``pip install wandb``); asking for a sink
whose package is missing is a configuration error before any work (``LoggingConfig``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from dtlab.checkpoint.safe_files import open_text
from dtlab.config import TrainConfig
from dtlab.trainers.metrics import RecordSink

__all__ = ["CSV_COLUMNS", "CsvSink", "TensorBoardSink", "WandbSink", "build_sinks", "scalars"]

CSV_COLUMNS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "eval_loss",
    "eval_accuracy",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "comm_s",
    "bytes_sent_MB",
    "memory_rank0_MB",
)
_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "step_time_s": "throughput/step_time_s",
    "comm_s": "throughput/comm_s",
    "bytes_sent_MB": "comm/bytes_sent_MB",
    "memory_rank0_MB": "memory/rank0_MB",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under the CSV column names (and ``compression/<name>``)."""
    out: dict[str, float] = {}
    for key in CSV_COLUMNS[1:10]:
        if isinstance(record.get(key), int | float):
            out[key] = float(record[key])
    sent = record.get("bytes_sent_per_rank")
    if isinstance(sent, list) and sent:
        out["bytes_sent_MB"] = max(sent) / 1e6
    memory = record.get("memory_per_rank")
    if isinstance(memory, list) and memory and isinstance(memory[0], dict):
        out["memory_rank0_MB"] = sum(v for v in memory[0].values() if isinstance(v, int | float)) / 1e6
    comp = record.get("compression")
    if isinstance(comp, dict):
        out.update({f"compression/{k}": float(v) for k, v in comp.items() if isinstance(v, int | float)})
    return out


class TensorBoardSink:
    """Event files in ``run_dir`` through ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        values = scalars(record)
        for pair in record.get("losses") or []:  # every step's training loss, not only the logged one
            if isinstance(pair, list) and len(pair) == 2 and pair[0] != step:
                self.writer.add_scalar("train/loss", float(pair[1]), global_step=int(pair[0]))
        for name, value in values.items():
            self.writer.add_scalar(_TAGS.get(name, name), value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """One W&B run (``wandb.init(project=..., dir=run_dir, config=...)``), the same tags as TensorBoard."""

    def __init__(self, run_dir: Path, config: TrainConfig) -> None:
        import wandb

        self.run: Any = wandb.init(
            project=config.logging.wandb_project, dir=str(run_dir), name=run_dir.name, config=config.to_dict()
        )

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        values = {_TAGS.get(k, k): v for k, v in scalars(record).items()}
        if isinstance(step, int) and values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class CsvSink:
    """``metrics.csv``: a header, then one row per record with the :data:`CSV_COLUMNS` it has."""

    def __init__(self, path: Path) -> None:
        fresh = not path.exists() or path.stat().st_size == 0
        self.file: IO[str] = open_text(path, True, "remove it, or choose another logging.run_dir")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if fresh:
            self.writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        row = scalars(record)
        if not row:
            return  # a record without numbers (a resume note): nothing for a table
        self.writer.writerow({"step": record.get("step"), **{k: f"{v:.6g}" for k, v in row.items()}})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def build_sinks(config: TrainConfig, run_dir: Path) -> list[RecordSink]:
    """The sinks ``config.logging`` asks for, writing into ``run_dir`` (rank 0 only)."""
    log = config.logging
    sinks: list[RecordSink] = []
    if log.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if log.wandb:
        sinks.append(WandbSink(run_dir, config))
    if log.csv:
        sinks.append(CsvSink(run_dir / "metrics.csv"))
    return sinks
