"""Pipeline parallelism's parts: schedules as data, the stage split, the runtime, p2p, zero-bubble (what
each file holds: docs/architecture.md, section "Model strategies");
:class:`~dtlab.models.PipelineParallelModel` runs them."""

from dtlab.core.pairs import SCHEDULES
from dtlab.core.plan import check_schedule_args
from dtlab.models.pipeline._plot import plot_schedule
from dtlab.models.pipeline._schedules import (
    Action,
    Kind,
    PipelineSchedule,
    Timeline,
    build_schedule,
    dry_run,
    simulate,
)
from dtlab.models.pipeline._zb import defer_weight_gradient, weight_gradient_queue

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "PipelineSchedule",
    "Timeline",
    "build_schedule",
    "check_schedule_args",
    "defer_weight_gradient",
    "dry_run",
    "plot_schedule",
    "simulate",
    "weight_gradient_queue",
]
