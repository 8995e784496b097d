"""The trainer: any (model strategy, optimizer strategy) pair, with checkpoints, metrics and a profile."""

from dtlab.trainers.guard import EarlyStopping, NonFiniteError, NonFiniteGuard
from dtlab.trainers.launch import run_training
from dtlab.trainers.metrics import MetricsCollector
from dtlab.trainers.preemption import StopRequest, finish_process, stop_on_signals
from dtlab.trainers.profiler import Profiler
from dtlab.trainers.tasks import Task, build_task
from dtlab.trainers.token_mean import SummedLoss
from dtlab.trainers.trainer import Trainer, TrainResult

__all__ = [
    "EarlyStopping",
    "MetricsCollector",
    "NonFiniteError",
    "NonFiniteGuard",
    "Profiler",
    "StopRequest",
    "SummedLoss",
    "Task",
    "TrainResult",
    "Trainer",
    "build_task",
    "finish_process",
    "run_training",
    "stop_on_signals",
]
