"""``seeded_init(seed)``: build a model reproducibly, on any backend, whatever other threads draw.

Everything drawn inside ``with seeded_init(seed):`` on the thread that entered it (module
initialisation: ``nn.Linear``, ``nn.init.*``, ``torch.randn``, ``Tensor.normal_``, ...) comes from the
block's own generators, one per device, seeded with ``seed``: a CPU ``torch.Generator`` and, for a
tensor on a GPU, that GPU's generator, made on first use. They give the numbers torch's global RNG
gives after ``torch.manual_seed(seed)``, so a model built in the block has the values, bit for bit, it
has when built right after seeding torch's global RNG. The block draws nothing from torch's global RNG:
draws made by other threads at the same time (in-memory ranks are threads of one process) cannot reach
the block's numbers, and the block's draws leave the other threads' numbers as they were. Tensors on
the meta device draw nothing.

How: the block pushes a torch dispatch mode, which sees only the ops of its own thread. It gives each
random op that was called without a generator the block's generator of the op's device (the op's own
``generator`` argument, or its overload that takes one: ``torch.randn`` -> ``aten.randn.generator``).
A random op that takes no generator at all (dropout inside a fused GPU kernel, a cuDNN RNN with
dropout, attention with ``dropout_p > 0`` on a GPU) is refused with an error naming it, never drawn
from the global RNG; so is a draw inside ``torch.utils.checkpoint``, whose backward would recompute it
from the global RNG's state (another dropout mask). Run such a model after the block (build it
inside, run it outside) or in eval mode.
A generator passed explicitly is used as given. ``torch.manual_seed`` and ``torch.get_rng_state``
inside the block act on torch's global RNG, which the block does not draw from: nest another
``seeded_init(other_seed)`` for a part that needs other numbers (the outer block's numbers continue
after it as if it had not run). A reseed of the global RNG inside the block (``torch.manual_seed`` in a
model's factory) is undone at its end, the global RNG's state set back to the one before the block: it
would otherwise outlive the block (each rank's dropout stream, seeded before the build, replaced).

The block also holds a process-wide lock, the one piece of module-level state in dtlab, on purpose: it
runs alone among the model builds of the process (``seeded_init`` and :func:`model_building` blocks),
since ``dtlab.models.init_empty_weights`` adds and removes global module hooks that every thread's
module constructors run, so every rank of every in-memory world in the process must see the same lock.
It is reentrant (a block may nest in another on the same thread). Ranks in their own processes (gloo,
MPI, NCCL) never contend.
"""

from __future__ import annotations

import inspect
import numbers
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._ops import OpOverload

from dtlab.core.random_ops import GeneratorMode
from dtlab.errors import ArgumentError, ArgumentTypeError, StrategyError

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
    """Run the block with every random op of this thread drawing from generators of its own, seeded
    with ``seed`` (the numbers torch's global RNG gives after ``torch.manual_seed(seed)``), alone in the
    process among model builds. torch's global RNG is not used, so other threads' draws neither change
    nor see the block's. Everything the block draws (module initialisation) is the same on every rank
    and in every run."""
    # torch's own errors do not name the call: "manual_seed expected a long", "Overflow"
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ArgumentTypeError(
            f"seeded_init(seed): seed must be an int, got {seed!r} ({type(seed).__name__})"
        )
    seed = int(seed)  # a NumPy integer, as torch.manual_seed takes it (torch.Generator's does not)
    if not -(2**63) <= seed < 2**64:  # torch.manual_seed's range
        raise ArgumentError(f"seeded_init(seed): seed must be in [-2**63, 2**64), got {seed}")
    with model_building(), _reseed_undone(), _OwnGenerators(seed):
        yield


@contextmanager
def _reseed_undone() -> Iterator[None]:
    """torch's global RNG (and, once CUDA is initialized, its GPUs') set back to its state before the
    block where code inside reseeded it (its initial seed changed: ``torch.manual_seed``,
    ``torch.seed``); left alone otherwise, so another thread's draws meanwhile stay drawn."""
    seed, state = torch.initial_seed(), torch.get_rng_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    gpus = torch.cuda.get_rng_state_all() if cuda else []
    try:
        yield
    finally:
        if torch.initial_seed() != seed:
            torch.set_rng_state(state)
            if cuda:
                torch.cuda.set_rng_state_all(gpus)


def _in_checkpoint() -> bool:
    """Whether ``torch.utils.checkpoint`` is on this thread's stack: a forward whose backward recomputes
    it from torch's global RNG state, or that recompute."""
    checkpoint = sys.modules.get("torch.utils.checkpoint")
    where = getattr(checkpoint, "__file__", None)
    frame = inspect.currentframe()
    while frame is not None and where is not None:
        if frame.f_code.co_filename == where:
            return True
        frame = frame.f_back
    return False


class _OwnGenerators(GeneratorMode):
    """Gives each random op of this thread called without a generator the block's generator of the op's
    device (made on first use, seeded with ``seed``); refuses a random op that takes no generator."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        # the CPU's made now: a bad seed is refused at the block's start, as torch.manual_seed does
        self.generators = {torch.device("cpu"): torch.Generator().manual_seed(seed)}

    def generator(self, func: OpOverload, device: torch.device) -> torch.Generator:
        """The block's generator of ``device``, for ``func``."""
        if _in_checkpoint():
            raise StrategyError(
                f"seeded_init({self.seed}): {func} draws random numbers inside torch.utils.checkpoint, "
                "whose backward recomputes the forward with torch's global RNG state, which the block "
                "does not draw from: the recomputed numbers (a dropout mask) would differ from the "
                "forward's; run the model after the block (build it inside seeded_init, run it outside)"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self.generators.get(device)
        if gen is None:  # a fresh generator seeded as torch.cuda.manual_seed_all(seed) seeds the GPU's
            gen = self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def refused(self, func: OpOverload, device: torch.device) -> Exception:
        return StrategyError(
            f"seeded_init({self.seed}): {func} draws random numbers on {device} from torch's global RNG "
            "and takes no generator, so the block cannot give it its own; run it after the block "
            "(build the model inside seeded_init, run it outside), with dropout 0, or in eval mode"
        )
