"""Hypothesis strategies that draw conformance case data (``hypothesis`` is a test dependency).

    from dtlab.testing.strategies import collective_cases, sizes_cases

    @given(st.lists(collective_cases(), min_size=1))
    def test_random_cases(cases): ...

The drawn values are plain case data (:class:`Case`, :class:`SizesCase`), so the same draws run on
every rank and travel pickled to spawned processes (``spawn_world(P, run_cases, ...)``).
"""

from __future__ import annotations

from hypothesis import strategies as st

from dtlab.backends.base import ReduceOp
from dtlab.testing._checking import ALL_DTYPES, FLOAT_DTYPES, Case, SizesCase

__all__ = ["collective_cases", "sizes_cases"]


@st.composite
def _collective_case(draw: st.DrawFn, max_dim: int) -> Case:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    ops = list(ReduceOp) if dtype in FLOAT_DTYPES else [o for o in ReduceOp if o is not ReduceOp.AVG]
    shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=0, max_size=3)))
    return Case(
        shape, dtype, draw(st.sampled_from(ops)), draw(st.integers(0, 7)), draw(st.integers(0, 2**20))
    )


def collective_cases(max_dim: int = 5) -> st.SearchStrategy[Case]:
    """A tensor collective's case: any dtype of the suite, an op valid for it (AVG on floats only), a
    0- to 3-d shape with dimensions 1..``max_dim``, a root 0..7 (taken modulo the world size), a seed."""
    return _collective_case(max_dim)


def sizes_cases(max_count: int = 6) -> st.SearchStrategy[SizesCase]:
    """Per-rank (all_gather_v) or per-pair (all_to_all) element counts 0..``max_count``, any dtype."""
    return st.builds(
        SizesCase,
        counts=st.lists(st.integers(0, max_count), min_size=1, max_size=5).map(tuple),
        dtype=st.sampled_from(ALL_DTYPES),
        seed=st.integers(0, 2**20),
    )
