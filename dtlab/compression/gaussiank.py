"""``GaussianK``: a threshold predicted from a Gaussian fit, adjusted toward k (Shi et al., 2019).

The threshold is the two-sided ``1 - density`` quantile of a normal distribution with the
accumulated gradient's mean and standard deviation; while it selects fewer than ``3k/4`` elements it
is lowered by 1.2% (at most 50 times), as in the reference code; while it selects more than ``5k/4``
it is raised by 1.2% (a pass over the selected subset only; the reference code never raises it, so
with error feedback its selection drifts far above k). No exact top-k is ever computed. The selected
entries (a different number per rank) travel with ``all_gather_v`` and are summed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression.base import Exchange, Prefilter, SparseCompressor
from dtlab.compression.kernels import gather_abs, std_mean, sum_sorted_runs
from dtlab.compression.sparse import Magnitudes, indices_above, pack, unpack

__all__ = ["GaussianK"]

LOWER = 1.012
MAX_ADJUST = 50
#: lowerings served by one pass over the buffer (its candidates are filtered for each)
LOWER_SPAN = 8


def _raised(
    idx: torch.Tensor, sel: torch.Tensor, thr: float, most: int, steps: int
) -> tuple[torch.Tensor, float]:
    """Raise ``thr`` by ``LOWER`` per step until at most ``most`` of the magnitudes ``sel`` (at
    ``idx``) are ``>= thr``, at most ``steps`` times: the entries kept and the threshold. The
    thresholds are the repeated products; the first one that keeps few enough is found by bisection
    (the count falls as the threshold rises), not by filtering once per step."""
    thresholds = [thr]
    for _ in range(max(0, steps)):
        thresholds.append(thresholds[-1] * LOWER)
    lo, hi = 0, len(thresholds) - 1  # the answer is in [lo, hi]: the last one when none suffices
    while lo < hi:
        mid = (lo + hi) // 2
        if int((sel >= thresholds[mid]).sum()) <= most:
            hi = mid
        else:
            lo = mid + 1
    return idx[sel >= thresholds[lo]], thresholds[lo]


@dataclass(frozen=True, kw_only=True)
class GaussianK(SparseCompressor):
    """Gaussian-predicted threshold adjusted toward ``[3k/4, 5k/4]``; variable-size all-gather."""

    name: ClassVar[str] = "gaussiank"

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return {"work": Magnitudes()}

    def prefilter(self, state: dict[str, Any], numel: int) -> Prefilter | None:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        """The accumulated gradient's mean and standard deviation, from the error-feedback pass."""
        work: Magnitudes = state["work"]
        return work.pre.request_moments()

    def threshold(self, acc: torch.Tensor, work: Magnitudes) -> tuple[torch.Tensor, float]:
        k = self.k(acc.numel())
        moments = work.pre.take_moments()
        std, mean = moments if moments is not None else std_mean(acc)
        z = float(torch.special.ndtri(torch.tensor(1.0 - self.density / 2, dtype=torch.float64)))
        thr = abs(mean) + std * (z if math.isfinite(z) else 0.0)
        if not thr > 0:
            return indices_above(acc, thr, k), thr  # |acc| > 0: every nonzero (no adjustment)
        loops, floor = 0, thr
        idx = cand = indices_above(acc, thr, 4 * k)  # room for 4k: a second pass only beyond
        mags = acc[:0]
        while idx.numel() < 3 * k // 4 and loops < MAX_ADJUST:
            thr /= LOWER
            loops += 1
            if thr < floor:  # one pass keeps the candidates of the next LOWER_SPAN lowerings
                floor = thr / LOWER**LOWER_SPAN
                cand = indices_above(acc, floor, 4 * k)
                mags = gather_abs(acc, cand)
            idx = cand[mags >= thr]  # the indices above thr (compared in float32, as the pass does)
        if idx.numel() > 5 * k // 4:  # too many: raise it, looking only at the selected subset
            idx, thr = _raised(idx, gather_abs(acc, idx), thr, 5 * k // 4, MAX_ADJUST - loops)
        return idx, thr

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p = backend.world_size
        t0 = time.perf_counter()
        idx, thr = self.threshold(acc, state["work"])
        state["threshold"] = thr
        select_s = time.perf_counter() - t0
        flat, counts = backend.all_gather_v(pack(idx, acc.index_select(0, idx)))
        uniq, sums = sum_sorted_runs(*unpack(flat), [c // 2 for c in counts])  # one sorted run per rank
        return Exchange.sparse(uniq, sums.div_(p), idx, idx.numel(), uniq.numel(), select_s)
