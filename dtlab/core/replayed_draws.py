"""``ReplayedDraws``: an activation checkpoint's recomputation draws the numbers its forward drew, on
in-memory ranks too.

``torch.utils.checkpoint`` (``preserve_rng_state``) sets torch's global RNG back to the state its
forward started from and draws the recomputation's dropout masks again. In-memory ranks are threads of
one process sharing that RNG: another rank's draws between that state and the forward's own draws
give the forward other numbers than the recomputation, and the gradients of another forward than the
loss's. On a :class:`~dtlab.backends.threads.RankThread`, a region run with :class:`ReplayedDraws` as
its ``context_fn`` draws its CPU random numbers from a generator of its own (a
:class:`~dtlab.core.random_ops.GeneratorMode`), seeded with one number drawn at the region's start
(from torch's global RNG, or from an enclosing region's generator), and its recomputation from that
generator seeded again: the same masks whatever the other ranks draw. Each region draws its own seed,
so the ranks draw different masks, as they do from the one RNG without checkpointing. A random op on
the CPU that takes no generator (``torch.native_dropout``) is refused there, naming the fix; on a GPU
the ops draw from the device's generator as torch's checkpoint handles it. On any other thread (a rank
in a process of its own, a one-rank world) the contexts do nothing: torch's own handling is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch._ops import OpOverload

from dtlab.backends.threads import on_rank_thread
from dtlab.core.random_ops import GeneratorMode, OpPlan, draw_seed
from dtlab.errors import StrategyError

__all__ = ["ReplayedDraws"]


class ReplayedDraws:
    """``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant) whose recomputation draws the random
    numbers (dropout masks) its forward drew on an in-memory rank, whatever the other ranks draw
    meanwhile; nothing on any other thread. One object serves every region: each call gives a region's
    pair of contexts (``checkpoint(f, x, use_reentrant=False, context_fn=ReplayedDraws())``)."""

    def __init__(self) -> None:
        self.plans: dict[OpOverload, OpPlan] = {}  # how each op draws, shared by the regions

    def __call__(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        if not on_rank_thread():
            return nullcontext(), nullcontext()
        seed: list[int] = []
        return self._forward(seed), self._recompute(seed)

    @contextmanager
    def _forward(self, seed: list[int]) -> Iterator[None]:
        # one draw (through an enclosing region's mode, if any: its recomputation draws the same seed)
        seed.append(draw_seed())
        with _RegionGenerator(seed[0], self.plans):
            yield

    @contextmanager
    def _recompute(self, seed: list[int]) -> Iterator[None]:
        with _RegionGenerator(seed[0], self.plans):
            yield


class _RegionGenerator(GeneratorMode):
    """The CPU random ops of this thread draw from a generator seeded with ``seed``; a CPU random op that
    takes no generator is refused; other devices' ops run as called."""

    def __init__(self, seed: int, plans: dict[OpOverload, OpPlan]) -> None:
        super().__init__(plans)
        self.cpu = torch.Generator().manual_seed(seed)

    def generator(self, func: OpOverload, device: torch.device) -> torch.Generator | None:  # noqa: ARG002 - GeneratorMode's interface; one generator for every op
        return self.cpu if device.type == "cpu" else None

    def refused(self, func: OpOverload, device: torch.device) -> Exception | None:
        if device.type != "cpu":
            return None
        return StrategyError(
            f"activation checkpointing on in-memory ranks: {func} draws random numbers on the CPU from "
            "torch's global RNG and takes no generator, so its recomputation in backward could draw "
            "other numbers than its forward (the ranks are threads sharing that RNG); use an op taking "
            "one (torch.nn.functional.dropout), run the ranks as processes (gloo), or leave this module "
            "uncheckpointed"
        )
