"""Pipeline parallelism: schedules as data (``build_schedule``), their dry run and ``plot_schedule``."""

from __future__ import annotations

from dtlab.models._pipeline_plot import plot_schedule
from dtlab.models._pipeline_schedules import (
    SCHEDULES,
    Action,
    Kind,
    PipelineSchedule,
    Timeline,
    build_schedule,
    check_schedule_args,
    dry_run,
    simulate,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "PipelineSchedule",
    "Timeline",
    "build_schedule",
    "check_schedule_args",
    "dry_run",
    "plot_schedule",
    "simulate",
]
