"""Whether a backward pass that reached a strategy's gradient hooks finished or raised partway.

Autograd runs a callback queued during a backward only when the whole pass succeeds. So a pass whose
callback has not run, found outside any backward, raised partway: the gradients it produced are
partial, and using them (a step, a reduction, the next backward adding into them) would carry part of
a skipped batch. The data-parallel model strategies and ``AsyncSGDOptimizer`` keep one
:class:`BackwardPass` each and refuse until ``zero_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtlab.core.torch_private import in_backward
from dtlab.errors import StrategyError

__all__ = ["BackwardPass"]


class BackwardPass:
    """``open``: a backward reached the hooks and has not finished; ``raised``: one raised partway, and
    the gradients stay partial until :meth:`forget`."""

    def __init__(self) -> None:
        self.open = False
        self.raised = False
        #: a pass that fills no ``.grad`` itself is running (:meth:`watch_outer`); what its end runs
        self._outer = False
        self._at_outer_end: Callable[[], None] | None = None
        self._otherwise: Callable[[], None] | None = None

    def begin(self, at_end: Callable[[], None]) -> bool:
        """From a gradient hook: the first one of a pass queues ``at_end`` (which calls :meth:`end`)
        and returns True; the later ones return False. Inside a pass :meth:`watch_outer` saw, ``at_end``
        runs at that pass's end instead."""
        if self.open:
            return False
        self.open = True
        if self._outer:
            self._at_outer_end = at_end
        else:
            _queue(at_end)
        return True

    def watch_outer(self, otherwise: Callable[[], None] | None = None) -> None:
        """From a pass that fills no ``.grad`` itself: ``torch.autograd.grad``, or the user's backward
        when every trainable parameter is inside reentrant checkpoints (``use_reentrant=True``), whose
        segments' backwards run nested in it, each a pass of its own that ends first. A pass those nested
        backwards begin ends with this one, once every segment has given its gradients; ``otherwise``
        runs at its end when none began."""
        if not (self._outer or self.open):
            self._outer, self._otherwise = True, otherwise
            _queue(self._outer_ended)

    @property
    def watching(self) -> bool:
        """A pass :meth:`watch_outer` saw is running."""
        return self._outer

    def _outer_ended(self) -> None:
        at_end, self._at_outer_end, self._outer = self._at_outer_end, None, False
        otherwise, self._otherwise = self._otherwise, None
        if at_end is not None:
            at_end()
        elif otherwise is not None:
            otherwise()

    def end(self) -> None:
        """The pass finished (its queued callback ran)."""
        self.open = False

    def found_raised(self) -> bool:
        """True once for a pass found still open outside any backward: it raised partway."""
        if in_backward():
            return False
        self._outer, self._at_outer_end, self._otherwise = False, None, None  # a watched pass that raised
        if self.open:
            self.open, self.raised = False, True
            return True
        return False

    def refuse(self, who: str, refused: str | None, produced: str = "some gradients were produced") -> None:
        """Raise, naming ``refused`` (a forward, a step; None: refuse nothing), while the gradients are
        partial; ``produced``: what the pass did before it raised."""
        if self.raised and refused is not None:
            raise StrategyError(
                f"{who}: a backward pass raised partway (an exception from an autograd Function, a tensor "
                f"hook or an out-of-memory error in backward) after {produced}, so the gradients are "
                f"partial and {refused} is refused. Call opt.zero_grad() on every rank where it raised to "
                "skip that batch, as plain training would, then go on with the next one"
            )

    def forget(self) -> None:
        """``zero_grad()``: the partial gradients are dropped."""
        self.raised = False


def _queue(fn: Callable[[], None]) -> None:
    """Run ``fn`` after the whole backward now running (autograd runs it only if the pass succeeds)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # noqa: SLF001 - torch's way to run after the whole backward (as torch DDP does)
