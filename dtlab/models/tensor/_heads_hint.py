"""A user's attention under tensor parallelism that reshapes a column-split projection by the whole
model's head count (``q.view(b, t, self.n_heads, head_dim)``) stops with torch's raw view error
("shape [...] is invalid for input of size N"): each tp rank's projection holds ``1/tp`` of its
features. :func:`head_count_hint` re-raises it naming the fixes where the shape would fit ``tp`` times
the input (a whole width asked of a split tensor); any other error passes unchanged (a reshape that
fails for another reason, a user's own bug in a module the plan leaves whole, keeps torch's error)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

from dtlab.errors import StrategyError

__all__ = ["head_count_hint"]

_VIEW_ERROR = re.compile(r"shape '\[([-\d, ]*)\]' is invalid for input of size (\d+)")


def _whole_width(message: str, tp: int) -> bool:
    """Whether torch's view error in ``message`` asks a shape that ``tp`` times the input would fill."""
    found = _VIEW_ERROR.search(message)
    if found is None:
        return False
    dims = [int(d) for d in found.group(1).split(",") if d.strip()]
    whole, known = int(found.group(2)) * tp, math.prod(d for d in dims if d != -1)
    if -1 in dims:
        return known > 0 and whole % known == 0
    return known == whole


@contextmanager
def head_count_hint(who: str, tp: int) -> Iterator[None]:
    """Around a forward of ``who`` split over ``tp`` ranks (nothing at ``tp == 1``)."""
    try:
        yield
    except RuntimeError as exc:
        if tp == 1 or not _whole_width(str(exc), tp):
            raise
        raise StrategyError(
            f"{who}: {exc}. At tp={tp} each rank's column-split projections ('colwise') hold 1/{tp} of "
            "their output features (this rank's heads), so a forward that reshapes them by the whole "
            "model's head count or width (q.view(b, t, self.n_heads, d // self.n_heads), "
            "y.reshape(b, t, d)) fails. Reshape by this rank's shape instead: -1 for the heads and a "
            "fixed head_dim (q.view(b, t, -1, self.head_dim)), -1 for the attention's output width "
            "(y.reshape(b, t, -1)); or split the attention with HeadsParallel(qkv=..., out=..., "
            f"heads='<its head-count attribute>', sections=1), which sets that attribute to heads // {tp} "
            "on each rank. plan='auto' handles Hugging Face models"
        ) from exc
