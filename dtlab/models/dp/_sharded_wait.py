"""A forward that only some ranks of a sharded strategy call, named within seconds.

Under ZeRO-3 and FSDP every rank must call forward: each holds ``1/P`` of the parameters and the
forward all-gathers them. A rank that evaluates alone (a DDP habit) would wait in that all-gather for
the collective timeout (minutes). The first gather of an evaluation (no-grad) forward is instead
polled for ``forward_wait_s`` and then named, where the engine's handle can be polled
(:attr:`dtlab.backends.types.Work.polls`: Gloo and NCCL; the in-memory world names a mismatched call
at once by itself; MPI waits as before).
"""

from __future__ import annotations

import time

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.errors import StrategyError

__all__ = ["wait_for_every_rank"]


def wait_for_every_rank(work: Work, seconds: float, who: str, group: CommunicationBackend) -> None:
    """Return once ``work`` completed; raise a :class:`StrategyError` naming the cause after
    ``seconds`` (the caller then stops: the gather is left pending)."""
    if not work.polls:
        return
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise StrategyError(
                f"{who} on rank {group.rank}: the forward waited {seconds:g} s for the other "
                f"{group.world_size - 1} rank(s) of its data-parallel group to gather the parameters. "
                "Under a sharded strategy every rank must call forward (each holds 1/P of the "
                "parameters), evaluation too: evaluate on every rank (each on its part of the data, "
                "then average the metric), or call model.state_dict() on every rank and evaluate a "
                "plain copy on one rank. If a rank is legitimately that late, pass a larger "
                "forward_wait_s"
            )
        time.sleep(0.0005)
