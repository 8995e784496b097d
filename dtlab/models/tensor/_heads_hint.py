"""A user's attention under tensor parallelism that reshapes a column-split projection by the whole
model's head count (``q.view(b, t, self.n_heads, head_dim)``) stops with torch's raw view error
("shape [...] is invalid for input of size N"): each tp rank's projection holds ``1/tp`` of its
features. :func:`head_count_hint` re-raises it naming the fixes; any other error passes unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dtlab.errors import StrategyError

__all__ = ["head_count_hint"]


@contextmanager
def head_count_hint(who: str, tp: int) -> Iterator[None]:
    """Around a forward of ``who`` split over ``tp`` ranks (nothing at ``tp == 1``)."""
    try:
        yield
    except RuntimeError as exc:
        if tp == 1 or "is invalid for input of size" not in str(exc):
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
