"""Parameters left whole whose gradient each tp rank computes only its share of (sequence parallelism's
norms and row-parallel biases, ``replicated_with_grad_allreduce``): summed over tp after each
synchronization, after the dp average (the two sums commute).

A gradient kept across steps (``opt.step()`` without ``zero_grad()``: torch adds the next backward into
``.grad``) still holds the last sum, the same on every tp rank; summing it again would count it tp
times. So the next forward with gradients keeps it on tp rank 0 only; a second synchronized backward before
the step is refused (:meth:`PartialGrads.before_accumulate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models.compose._comm import grads_of
from dtlab.models.tensor._comm import sum_over_tp

if TYPE_CHECKING:
    from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["PartialGrads"]


class PartialGrads:
    """The partial gradients of the parameters ``names`` (none at tp = 1) of ``dp``'s module."""

    def __init__(self, dp: DataParallelModel, names: set[str], tp: CommunicationBackend) -> None:
        self.dp, self.names, self.tp = dp, names, tp
        #: whether the gradients may hold a sum over tp made since the last zero_grad()
        self._summed = False
        if names:
            dp.register_post_sync_hook(self.sum)

    def sum(self) -> None:
        """After the dp reduction: each partial gradient summed over tp."""
        sum_over_tp(grads_of(self.dp, self.names.__contains__), self.tp)
        self._summed = True

    def before_accumulate(self, who: str) -> None:
        """Before a forward with gradients or a pipelined step of the model ``who``: refused while the
        last synchronized gradients are there (before the step); a sum over tp kept from the last step
        stays on tp rank 0 only, so the next sum counts it once."""
        dp = self.dp
        if self.names and dp.require_backward_grad_sync and dp.grads_synced:
            raise StrategyError(
                f"{who} with sequence parallelism: a synchronized step started while the "
                "gradients of the last one are still there; call opt.zero_grad() between steps and "
                "accumulate micro-batches inside model.no_sync()"
            )
        if self._summed:
            self._summed = False
            if self.tp.rank:
                for g in grads_of(self.dp, self.names.__contains__):
                    g.zero_()

    def cleared(self) -> None:
        """``zero_grad()``: nothing summed is held any more."""
        self._summed = False
