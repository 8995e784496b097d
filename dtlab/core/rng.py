"""``seeded_init(seed)``: build a model from torch's global RNG reproducibly, on any backend.

In-memory ranks are threads of one process and share torch's global RNG: a rank that builds its
model (``nn.Linear`` draws from the global RNG) while another rank seeds or draws gets numbers meant
for the other, and the initial model changes from run to run. Inside ``seeded_init`` the global RNG
is seeded with ``seed`` and restored afterwards, under a lock held by one thread at a time.

That lock is the one piece of module-level state in dtlab, on purpose: it guards resources that
themselves belong to the whole process (torch's global RNG; the global module hooks that
``dtlab.models.init_empty_weights`` adds and removes, through :func:`model_building`), so every rank of
every in-memory world in the process must see the same lock. It is reentrant (a block may nest in
another on the same thread). Ranks in their own processes (gloo, MPI, NCCL) never contend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["model_building", "seeded_init"]

_GLOBAL_RNG_LOCK = threading.RLock()


@contextmanager
def model_building() -> Iterator[None]:
    """Run the block alone in the process among model builds (``seeded_init`` blocks included): for
    code that changes torch's process-wide state while it builds a model."""
    with _GLOBAL_RNG_LOCK:
        yield


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded with ``seed``, alone in the process; the RNG state
    from before the block is restored after it. Everything the block draws (module initialisation)
    is the same on every rank and in every run."""
    with model_building(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
