"""Pipeline parallelism's parts: schedules as data, the stage split, the runtime, p2p, zero-bubble.

``_actions.py`` and ``_schedules.py``: ``Action``, ``PipelineSchedule`` (GPipe, 1F1B, interleaved 1F1B,
ZB-H1), the dry run and the simulation; ``_plot.py``: ``plot_schedule``; ``_split.py``: blocks, split
points, stage shapes; ``_runtime.py``: running a rank's actions; ``_comm.py``: batched p2p; ``_zb.py``:
zero-bubble's input/weight gradient split. The model that runs them is
:class:`~dtlab.models.PipelineParallelModel` (:mod:`dtlab.models.compose`).
"""

from dtlab.models.pipeline._plot import plot_schedule
from dtlab.models.pipeline._schedules import (
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
