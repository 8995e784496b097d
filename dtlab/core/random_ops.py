"""``GeneratorMode``: a torch dispatch mode handing the random ops of its thread generators of its own.

A dispatch mode sees only the ops of the thread that entered it. For each random op called without a
generator it asks :meth:`GeneratorMode.generator` for one (the op's own ``generator`` argument, or its
overload that takes one: ``torch.randn`` -> ``aten.randn.generator``; ``rand*_like``, which take none
in some torch releases, run as their kernel runs them). A random op that takes no generator at all
(``torch.native_dropout``, dropout inside a fused GPU kernel, attention with ``dropout_p > 0`` on a
GPU) is passed to :meth:`GeneratorMode.refused`; with arguments that make it draw nothing (dropout 0,
eval) it runs as called. Ops on the meta device draw nothing. A generator the caller passed is used as
given. Used by :func:`dtlab.core.rng.seeded_init` (a model's initialisation) and
:class:`dtlab.core.replayed_draws.ReplayedDraws` (an activation checkpoint's dropout on in-memory
ranks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.core.torch_private import op_arguments

__all__ = ["GeneratorMode", "OpPlan", "draw_like", "draw_seed", "plan_of"]

#: the seeds a region draws: below torch's bound for ``manual_seed``, well inside int64
_SEEDS = 2**62

#: arguments of random ops that take no generator which, at 0 or False, make the op draw nothing
_DROPOUT_ARGS = ("p", "dropout_p", "dropout")
_TRAIN_ARGS = ("train", "training", "is_training")
#: the ``rand*_like`` overloads :func:`draw_like` runs with a generator where torch's take none
_LIKE = (
    "aten.rand_like.default",
    "aten.randn_like.default",
    "aten.randint_like.default",
    "aten.randint_like.low_dtype",
)


def draw_seed() -> int:
    """One seed for a region's own generator, drawn from the stream in place (a recomputation that
    restored that stream draws the same one)."""
    return int(torch.randint(_SEEDS, ()).item())


@dataclass(frozen=True)
class OpPlan:
    """How a :class:`GeneratorMode` runs one op: ``slot`` is the index and name of its generator
    argument (and whether it is keyword-only); ``sibling`` its overload taking a generator; ``like`` a
    ``rand*_like`` of a torch release where it takes none (run as its kernel runs it, see
    :func:`draw_like`); ``refuse`` a random op that takes none; none of them: an op that draws nothing."""

    slot: tuple[int, str, bool] | None = None
    sibling: OpOverload | None = None
    like: bool = False
    refuse: bool = False

    @property
    def draws(self) -> bool:
        return self.slot is not None or self.sibling is not None or self.like or self.refuse


def _generator_slot(op: OpOverload) -> tuple[int, str, bool] | None:
    for i, arg in enumerate(op_arguments(op)):
        if str(arg.type).rstrip("?") in ("Generator", "Optional[Generator]"):
            return i, arg.name, arg.kwarg_only
    return None


def plan_of(func: OpOverload) -> OpPlan:
    """How ``func`` draws: see :class:`OpPlan`."""
    slot = _generator_slot(func)
    if slot is not None:
        return OpPlan(slot=slot)
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return OpPlan()
    names = [a.name for a in op_arguments(func)]
    packet = func.overloadpacket
    for overload in packet.overloads():
        sibling = getattr(packet, overload)
        sibling_slot = _generator_slot(sibling)
        if sibling_slot is None or not sibling_slot[2]:
            continue
        if [a.name for a in op_arguments(sibling) if a.name != sibling_slot[1]] == names:
            return OpPlan(sibling=sibling)
    if str(func) in _LIKE:
        return OpPlan(like=True)
    return OpPlan(refuse=True)


def draw_like(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], gen: torch.Generator) -> Any:
    """``torch.rand_like``, ``randn_like`` or ``randint_like`` (``func``, called with ``args`` and
    ``kwargs``) drawing from ``gen``, for torch releases where they take no generator: as their kernel
    runs them, an ``empty_like`` of the same options filled in place."""
    aten = torch.ops.aten
    fresh = aten.empty_like.default(args[0], **kwargs)
    name = str(func)
    if name == "aten.rand_like.default":
        return aten.uniform_.default(fresh, 0.0, 1.0, generator=gen)
    if name == "aten.randn_like.default":
        return aten.normal_.default(fresh, 0.0, 1.0, generator=gen)
    low, high = (0, args[1]) if name == "aten.randint_like.default" else (args[1], args[2])
    return getattr(aten.random_, "from")(fresh, low, high, generator=gen)


def _device(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.device:
    """The device an op draws on: its ``device`` argument, else that of its first tensor, else the CPU."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _draws_nothing(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a random op taking no generator draws nothing with these arguments (dropout 0, eval)."""
    for i, arg in enumerate(op_arguments(func)):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name, arg.default_value)
        if (arg.name in _DROPOUT_ARGS and value == 0) or (arg.name in _TRAIN_ARGS and value is False):
            return True
    return False


class GeneratorMode(TorchDispatchMode):
    """Runs each random op of this thread called without a generator with :meth:`generator`'s (``None``:
    as called); a random op that takes none, where it draws, raises :meth:`refused`'s error (``None``:
    runs as called). ``plans``: how each op draws, filled as ops are met (share one mapping between
    modes entered often: working out an op's plan reads its schema)."""

    def __init__(self, plans: dict[OpOverload, OpPlan] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.plans: dict[OpOverload, OpPlan] = {} if plans is None else plans

    def generator(self, func: OpOverload, device: torch.device) -> torch.Generator | None:
        """The generator ``func`` draws from on ``device``; ``None``: torch's default, as called."""
        raise NotImplementedError

    def refused(self, func: OpOverload, device: torch.device) -> Exception | None:
        """The error for ``func``, a random op taking no generator, drawing on ``device`` (``None``: run
        it as called)."""
        raise NotImplementedError

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        plan = self.plans.get(func)
        if plan is None:
            plan = self.plans[func] = plan_of(func)
        if not plan.draws:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        device = _device(args, kwargs)
        if device.type == "meta":  # draws nothing
            return func(*args, **kwargs)
        if plan.refuse:
            error = None if _draws_nothing(func, args, kwargs) else self.refused(func, device)
            if error is not None:
                raise error
            return func(*args, **kwargs)
        if plan.slot is not None:
            index, name, kwarg_only = plan.slot
            positional = not kwarg_only and index < len(args)
            if (args[index] if positional else kwargs.get(name)) is not None:  # the caller's own
                return func(*args, **kwargs)
        gen = self.generator(func, device)
        if gen is None:
            return func(*args, **kwargs)
        if plan.slot is not None:
            if positional:
                args = (*args[:index], gen, *args[index + 1 :])
            else:
                kwargs[name] = gen
            return func(*args, **kwargs)
        if plan.sibling is not None:
            return plan.sibling(*args, **kwargs, generator=gen)
        return draw_like(func, args, kwargs, gen)
