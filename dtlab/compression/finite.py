"""The non-finite check of one compressed call, decided identically on every rank before any payload.

Each rank counts the NaN/Inf values of its accumulated gradient ``acc``; the decision (go on, or send
nothing, leave the residual as it was and raise or skip) needs every rank's count, so it takes one
exchange of ``P`` integers. :meth:`FiniteCheck.exchange` is that exchange on its own (one all-reduce);
a compressor whose first exchange is already a count exchange (Ok-Topk's split-and-reduce) sends
:attr:`FiniteCheck.bad` along with its counts and calls :meth:`FiniteCheck.decide` with every rank's
value before anything else moves, saving a collective round per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp

__all__ = ["ExchangeSkipped", "FiniteCheck"]


class ExchangeSkipped(Exception):
    """Raised by :meth:`FiniteCheck.decide` on every rank when some rank's ``acc`` is not finite and
    the policy is to skip: the compressor stops before any payload moves, the reducer catches it."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(f"compressed exchange skipped: non-finite values per rank {counts}")
        self.counts = counts


class FiniteCheck:
    """This rank's NaN/Inf count ``bad`` and the decision taken on every rank's count.

    ``on_nonfinite(per_rank)`` is called (on every rank, with the same list) when any count is
    nonzero: it records the event and raises the policy's error, or returns to skip the exchange
    (:meth:`decide` then raises :class:`ExchangeSkipped`). :attr:`decided` says whether the decision
    has been taken (a compressor that folds the counts into its own exchange must take it first)."""

    def __init__(self, bad: int, on_nonfinite: Callable[[list[int]], None]) -> None:
        self.bad = int(bad)
        self.decided = False
        self._on_nonfinite = on_nonfinite

    def decide(self, per_rank: list[int]) -> None:
        """Take the decision on every rank's count (the same list on every rank): return when all are
        zero, else ``on_nonfinite`` raises, or :class:`ExchangeSkipped` is raised."""
        self.decided = True
        if sum(per_rank) == 0:
            return
        self._on_nonfinite(per_rank)
        raise ExchangeSkipped(per_rank)

    def exchange(self, backend: CommunicationBackend) -> None:
        """The check on its own: one all-reduce of the ``P`` int32 counts, then :meth:`decide`."""
        p, me = backend.world_size, backend.rank
        counts = torch.zeros(p, dtype=torch.int32, device=backend.device)
        counts[me] = self.bad
        if p > 1:
            backend.all_reduce(counts, ReduceOp.SUM)
        self.decide([int(c) for c in counts.cpu().tolist()])
