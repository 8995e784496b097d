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
    """Run the block with torch's CPU RNG (and, once CUDA is initialized, its GPUs') seeded with
    ``seed``, alone in the process; the RNG state from before the block is restored after it.
    Everything the block draws (module initialisation) is the same on every rank and in every run."""
    # CUDA's generators too, restored after the block, when CUDA is up: a module built on the GPU draws
    # from them. Not torch.manual_seed: with CUDA not yet initialized it queues a seed of every CUDA
    # generator for CUDA's first use (here or later) that no fork restores, and every rank's GPU RNG,
    # its dropout after the build, would start from ``seed``
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with model_building(), torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        yield
