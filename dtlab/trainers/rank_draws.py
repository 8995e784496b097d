"""``RankDraws``: on in-memory ranks, each rank's training draws (dropout) from a CPU generator of its
own, seeded as a launcher seeds a rank's process, and kept in its checkpoints.

In-memory ranks are threads of one process sharing torch's global RNG: which rank draws which dropout
mask would depend on the threads' timing, so two runs (and a run and its resume) would differ. Under
:class:`RankDraws` the forward and backward of each micro-batch on a
:class:`~dtlab.backends.threads.RankThread` run inside a :class:`~dtlab.core.random_ops.GeneratorMode`
handing every CPU random op called without a generator this rank's generator, seeded with
``train.seed + 1 + rank // parallel.tp``: what ``dtlab train`` seeds a rank's process with under a
launcher (the ranks of one tp group draw alike, each dp replica and pipeline rank its own; between a
column-parallel layer and its row-parallel partner each tp rank draws from a generator seeded from this
stream and its tp rank: ``dtlab/models/tensor/_split_draws.py``), so in-memory ranks draw the masks a
launched run draws. Its state is saved with the rank's RNG states and restored
where those are (same world size and ``parallel.tp``). ``run_training`` runs a one-rank in-memory world
on a ``RankThread`` too, so its draws do not depend on the state a caller left torch's global RNG in.
Elsewhere (a rank in a process of its own, a one-rank ``run_world`` on the caller's thread) it does
nothing: torch's global RNG is the rank's own, saved and restored as it is. A CPU random op that takes
no generator (``torch.native_dropout``) is refused on an in-memory rank, naming the fixes; so is a CPU
draw in backward: a recomputation of ``torch.utils.checkpoint`` without
:class:`~dtlab.core.replayed_draws.ReplayedDraws` would draw from
this generator other numbers (dropout masks) than its forward drew.

The mode sees every op in Python (a small op's dispatch about twice as long), so it is kept only where
the model draws: the first micro-batch runs under it, and so does the next one after any change of the
model's settings (a module's ``train()``/``eval()``, a module added or removed, a number, bool or string
attribute of a module: a dropout's ``p``, a stochastic-depth flag); once one drew, the mode stays. A
model that starts drawing later (dropout raised after a warm-up) so draws from the start of its
generator, what a run that had the mode all along draws. In between, torch's shared CPU generator is
watched (its state compared before and after each micro-batch): draws that began without such a change
are refused at the next micro-batch, rather than taken from the generator the threads share.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload

from dtlab.backends.threads import on_rank_thread
from dtlab.core.random_ops import GeneratorMode, OpPlan
from dtlab.core.rng import model_building
from dtlab.core.settings_watch import SettingsWatch
from dtlab.core.torch_private import in_backward
from dtlab.errors import CheckpointError, StrategyError

__all__ = ["RankDraws"]

#: the key of the rank's generator state in ``state_rank*.safetensors``
KEY = "rank_draws_cpu"


class _RankMode(GeneratorMode):
    def __init__(self, owner: RankDraws) -> None:
        super().__init__(owner.plans)
        self.owner = owner

    def generator(self, func: OpOverload, device: torch.device) -> torch.Generator | None:
        if device.type != "cpu":
            return None
        if in_backward():  # the forward's draws were this generator's earlier numbers
            raise StrategyError(
                f"in-memory ranks: {func} draws random numbers on the CPU in backward: a recomputation "
                "(torch.utils.checkpoint without dtlab's replayed draws) would draw other numbers than "
                "its forward drew from this rank's generator (other dropout masks: the gradients of "
                "another forward); pass context_fn=ReplayedDraws() (from dtlab.models.checkpointing "
                "import ReplayedDraws; checkpoint(f, x, use_reentrant=False, context_fn=ReplayedDraws())), "
                "use strategy.activation_checkpointing, or run the ranks as processes (torchrun with "
                "backend.name=gloo, mpiexec with mpi)"
            )
        self.owner.drew = True
        return self.owner.generator

    def refused(self, func: OpOverload, device: torch.device) -> Exception | None:
        if device.type != "cpu":
            return None
        return StrategyError(
            f"in-memory ranks: {func} draws random numbers on the CPU from torch's global RNG and takes "
            "no generator, so which rank draws which numbers would depend on the threads' timing (the "
            "ranks are threads sharing that RNG: no two runs, nor a run and its resume, would train "
            "alike); use an op taking one (torch.nn.functional.dropout), or run the ranks as processes "
            "(torchrun with backend.name=gloo, mpiexec with mpi)"
        )


class RankDraws:
    """This rank's training draws; ``on`` only on a :class:`RankThread` (``run_training`` runs a one-rank
    in-memory world on one too).

    The mode sees every op in Python, so it is kept only where the model draws: a micro-batch is
    *probed* (run under the mode, which notes whether anything drew) first, and again whenever the
    model's settings (:class:`~dtlab.core.settings_watch.SettingsWatch`) changed since the last
    micro-batch began; once a probe drew, the mode stays. In between (a model that draws nothing, at
    full speed) torch's shared CPU generator is watched: if it moved during a micro-batch, the next one
    is probed, and if that draws, the draws began where no setting changed and came from the shared
    generator: refused. ``model``: the module whose settings are watched (``None``: none)."""

    def __init__(self, seed: int, rank: int, tp: int, model: nn.Module | None = None) -> None:
        self.on = on_rank_thread()
        self.rank = rank
        self.generator = torch.Generator().manual_seed(seed + 1 + rank // tp)
        self.plans: dict[OpOverload, OpPlan] = {}  # how each op draws, shared by every micro-batch
        self.watch = None if model is None else SettingsWatch(model)
        self.drew = False  # a probe drew: the mode stays on
        self.probe = True  # the next micro-batch runs under the mode
        self.moved = False  # the shared generator moved during the last micro-batch (not probed)
        self.micro = 0  # micro-batches run

    @property
    def active(self) -> bool:
        """Whether the next micro-batch draws from this rank's generator (where the model draws)."""
        return self.on and (self.drew or self.probe)

    def __call__(self) -> AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward."""
        if not self.on:
            return nullcontext()
        self.micro += 1
        if self.drew:
            return _RankMode(self)
        if self.watch is not None and self.watch.changed():
            self.probe = True
        return self._probed() if self.probe or self.moved else self._watched()

    @contextmanager
    def _probed(self) -> Iterator[None]:
        with _RankMode(self):
            yield
        if self.moved and self.drew and not self.probe:
            raise StrategyError(
                f"in-memory ranks: rank {self.rank}'s model began drawing random numbers on the CPU "
                f"(dropout) in its micro-batch {self.micro - 1} (counted from 1 in this Trainer), "
                "though its earlier micro-batches drew none and none of the settings dtlab watches "
                "changed (a module's train()/eval(), a module added or removed, a public number, "
                "bool or string attribute of a module such as a dropout's p): those draws came from "
                "torch's global RNG, which the ranks (threads) share, so which rank drew which "
                "numbers depended on the threads' timing; turn the draws on through such a setting "
                "(set the module's p, call train()), or run the ranks as processes (torchrun with "
                "backend.name=gloo, mpiexec with mpi)"
            )
        self.probe = self.moved = False

    @contextmanager
    def _watched(self) -> Iterator[None]:
        # read where no other rank's fetch has it seeded (worker_draws.ThreadFetch, under this lock)
        with model_building():
            shared = torch.default_generator.get_state()
        yield
        with model_building():
            self.moved = not torch.equal(torch.default_generator.get_state(), shared)

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of it (nothing where it is inactive: the model has drawn nothing from
        it, which a fresh one is again)."""
        return {KEY: self.generator.get_state()} if self.active else {}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a rank's saved state (off, or saved without it: its own, never drawn from, stays)."""
        saved = state.get(KEY)
        if not self.on or saved is None:
            return
        own = self.generator.get_state()
        if saved.dtype != own.dtype or saved.shape != own.shape:
            raise CheckpointError(
                f"the saved {KEY} of rank {self.rank} is a {saved.dtype} tensor of shape "
                f"{tuple(saved.shape)}, not a CPU generator's state ({own.dtype}, {tuple(own.shape)}); "
                "resume from another step directory"
            )
        self.generator.set_state(saved)
