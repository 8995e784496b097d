"""``PlacedSampler`` (``trainers/worker_draws.py``, the keys of ``data.num_workers > 0``) makes each
sample's key as the loader asks for it: a whole epoch's keys built at each ``iter(loader)`` cost about 6x
the memory of the sampler's own index list before the first batch (2M samples a rank: 460 MiB, seconds)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

from dtlab.data import DistributedSampler
from dtlab.trainers.worker_draws import PlacedSampler


class _Sized:
    def __len__(self) -> int:
        return 100_000


def _peak(fn: Callable[[], object]) -> int:
    """Bytes ``fn`` allocated at its peak (tracing left on where something else traces already)."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
        del kept
    finally:
        if not tracing:
            tracemalloc.stop()
    return peak


def test_an_epochs_keys_are_made_as_the_loader_asks_for_them() -> None:
    sampler = DistributedSampler(_Sized(), num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(2)
    own = _peak(lambda: iter(sampler))  # the sampler's own index list
    placed = PlacedSampler(sampler)
    keyed = _peak(lambda: next(iter(placed)))
    assert keyed < 2 * own, (keyed, own)
    keys = list(placed)
    assert [k for k, _ in keys[:3]] == [(3, 2, 1), (3, 2, 3), (3, 2, 5)]  # rank 1 of 2: places 1, 3, 5
    assert [i for _, i in keys] == list(sampler) and len(keys) == len(placed)
