"""A compressed step the optimizer did not apply leaves no trace; a buffer's momentum steps once a step.

Every reduction changes the reducer's state: error-feedback residuals, momentum-correction velocities
and iteration counts. A step that is then skipped (a non-finite gradient on some rank: the Trainer's
guard, or ``grads_are_finite()`` in a loop, followed by ``zero_grad()`` without ``step()``) must
leave them as they were, as one process skipping that step keeps no part of its batch:
:meth:`StepLog.undo` puts back every buffer reduced since the last applied step. The compressor's own
state (Ok-Topk's thresholds and region boundaries, PowerSGD's warm-start factors, GaussianK's
threshold) keeps the skipped step's update: it steers the selection and holds no gradient.

It relies on :class:`~dtlab.compression.error_feedback.ErrorFeedback` swapping buffers: after one
change the tensors that held a buffer's residual and velocity before it are kept, untouched, as
spares until the buffer's next change. A buffer reduced again before the step (several synchronized
backwards without ``zero_grad()`` between: accumulation outside ``no_sync()``) gets copies of them
first; under momentum correction that second reduction is refused instead, since it would decay the
velocity twice in one step where torch's ``SGD(momentum)`` takes one step on the summed gradient.
"""

from __future__ import annotations

import torch

from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.errors import StrategyError

__all__ = ["StepLog"]


class StepLog:
    """What each buffer held before the first reduction since the last applied step. Off until
    ``enabled`` (an optimizer that says when a step is applied: ``GradientCompressionOptimizer``)."""

    def __init__(self, feedback: ErrorFeedback, counts: dict[str, int], rank: int) -> None:
        self.enabled = False
        self._feedback, self._counts, self._rank = feedback, counts, rank
        #: key -> (iteration count, None where absent; residual; velocity; whether those are copies)
        self._before: dict[str, tuple[int | None, torch.Tensor | None, torch.Tensor | None, bool]] = {}

    def before(self, key: str) -> None:
        """Called before a reduction of ``key`` changes its state."""
        if not self.enabled:
            return
        ef, seen = self._feedback, self._before.get(key)
        if seen is None:
            self._before[key] = (self._counts.get(key), ef.residual(key), ef.velocity(key), False)
            return
        if ef.momentum is not None:
            raise StrategyError(
                f"gradient compression with momentum_correction={ef.momentum} on rank {self._rank}: buffer "
                f"{key!r} is reduced a second time since the last opt.step() (a second synchronized backward "
                "without opt.zero_grad() between them: gradient accumulation outside model.no_sync()), which "
                "would take two momentum steps of its velocity in one optimizer step, where torch's "
                "SGD(momentum) takes one on the summed gradient. Run every backward but the last of a step "
                "inside `with model.no_sync():` (as the Trainer does), and call opt.zero_grad() (the "
                "optimizer's, not the module's) after a step you skip"
            )
        count, res, vel, copied = seen
        if not copied:  # the next change reuses the spares that hold them: keep copies
            self._before[key] = (count, _copy(res), _copy(vel), True)

    def settle(self) -> None:
        """The optimizer applied the step: what the reductions changed stays."""
        self._before.clear()

    def undo(self) -> None:
        """The step was not applied: every buffer reduced since the last applied step gets its
        residual, velocity and iteration count back."""
        for key, (count, res, vel, _) in self._before.items():
            self._feedback.restore(key, res, vel)
            if count is None:
                self._counts.pop(key, None)
            else:
                self._counts[key] = count
        self._before.clear()


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
