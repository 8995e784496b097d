"""What a compressor asks of the error-feedback pass: :class:`Prefilter`.

The reducer computes ``acc = grad + residual`` in one pass over the buffer before a compressor's
call (:class:`~dtlab.compression.error_feedback.ErrorFeedback`); a compressor whose own first pass
reads ``acc`` too asks for its work to be done in that pass instead (a magnitude selection, the mean
and standard deviation, or a whole fused pass of its own), through :meth:`Compressor.prefilter
<dtlab.compression.base.Compressor.prefilter>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dtlab.compression.state_io import Workspace

__all__ = ["FusedPass", "Prefilter"]

#: ``fused(source, residual, acc)``: a compressor's error-feedback pass (:meth:`Prefilter.request_fused`)
FusedPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "int | None"]


class Prefilter(Workspace):
    """A selection the error-feedback pass makes while it computes ``acc = grad + residual``.

    A compressor that selects by magnitude asks for it (:meth:`Compressor.prefilter`): the reducer
    then writes ``acc`` and the sorted indices with ``|acc| >= threshold`` in the same pass over memory
    (:func:`dtlab.compression.kernels.add_select`) and leaves them in :attr:`indices` for the
    compressor's call that follows. The threshold is fixed (:meth:`request`) or chosen from a sample
    of ``|acc|`` at given positions, read from ``grad`` and the residual before the pass
    (:meth:`request_sampled`; the same float32 sums the pass writes, so the same threshold the
    compressor would choose from ``acc``). ``expected``: the count the compressor expects (room
    reserved). :attr:`indices` stays ``None`` when the pass could not select (the first step, with no
    residual yet, or a threshold that is not positive): the compressor then makes its own pass.
    A compressor with a pass of its own to fuse (PowerSGD's ``M Q``) hands the whole pass over
    instead (:meth:`request_fused`). Scratch: never saved, and the result never depends on whether
    the indices came from here.
    """

    def __init__(self) -> None:
        self.threshold = 0.0
        self.expected = 0
        self.indices: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._choose: Callable[[torch.Tensor], float] | None = None
        self.wants_moments = False
        self.moments: tuple[float, float] | None = None
        #: set by the reducer: the gradient may be zeroed in the pass (it receives the result next)
        self.zero_source = False
        #: set by the pass: the gradient was zeroed (a sparse result is then scattered into it)
        self.source_zeroed = False
        self.fused: FusedPass | None = None
        self.fused_done = False

    def request_fused(self, fused: FusedPass) -> Prefilter:
        """Ask for the pass to be ``fused(source, residual, acc)``: it writes ``acc = source +
        residual``, does the compressor's own work on the way and returns the number of NaN/Inf values
        of ``acc``, or ``None`` without writing anything where it cannot run (the plain pass runs then).
        :meth:`take_fused` tells the compressor whether it ran."""
        self.request(0.0, 0)
        self.fused, self.fused_done = fused, False
        return self

    def take_fused(self) -> bool:
        """Whether the pass was the fused one (once)."""
        done, self.fused_done = self.fused_done, False
        return done

    def request_moments(self) -> Prefilter:
        """Ask for ``std_mean(acc)`` (:func:`dtlab.compression.kernels.std_mean`) instead of
        indices, computed in the same pass (into :attr:`moments`; ``None`` when it was not)."""
        self.request(0.0, 0)
        self.wants_moments = True
        return self

    def request(self, threshold: float, expected: int) -> Prefilter | None:
        """Ask for the indices with ``|acc| >= threshold`` (nothing is asked unless it is positive)."""
        self.indices, self._positions, self._choose = None, None, None
        self.wants_moments, self.moments, self.fused = False, None, None
        if not threshold > 0 or not math.isfinite(threshold):
            return None
        self.threshold, self.expected = float(threshold), int(expected)
        return self

    def request_sampled(
        self, positions: torch.Tensor, choose: Callable[[torch.Tensor], float], expected: int
    ) -> Prefilter:
        """Ask for the indices above ``choose(|acc[positions]|)``."""
        self.indices, self._positions, self._choose = None, positions, choose
        self.threshold, self.expected = 0.0, int(expected)
        self.wants_moments, self.moments, self.fused = False, None, None
        return self

    def resolve(self, sample: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """The threshold to select with; ``sample(positions)`` gives ``|acc|`` there."""
        if self._positions is not None and self._choose is not None:
            self.threshold = float(self._choose(sample(self._positions)))
        return self.threshold

    def take_moments(self) -> tuple[float, float] | None:
        """``(std, mean)`` of ``acc`` from the pass (once; ``None`` when there are none)."""
        moments, self.moments = self.moments, None
        return moments

    def take(self) -> tuple[float, torch.Tensor] | None:
        """The threshold and the indices the pass selected (once; ``None`` when there are none)."""
        idx, self.indices = self.indices, None
        return None if idx is None else (self.threshold, idx)
