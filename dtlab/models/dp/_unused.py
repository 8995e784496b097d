"""Parameters no rank computed a gradient for (``find_unused_parameters=True``).

torch's optimizers skip a parameter whose ``.grad`` is None: no momentum, no weight decay, no Adam
step. One process leaves that ``.grad`` None (after ``zero_grad()``) for a parameter its loss did not
reach, and so does torch's DDP when no rank reached it (it all-reduces a map of the parameters each rank
used). The strategies reduce zeros for such a parameter; :class:`UsedParams` marks the parameters that
got a gradient on this rank since ``zero_grad()`` and, after each synchronization, all-reduces the marks
(MAX, one float64 per trainable parameter), so the optimizer strategy leaves out those no rank used.

Without ``find_unused_parameters`` the marks stay local: a pipeline's step, which reduces its
accumulated gradients once at the end, refuses parameters no micro-batch used on every pipeline rank
before reducing (:meth:`UsedParams.unused_here`, :func:`stage_unused_error`), rather than step them
with zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError

__all__ = ["UsedParams", "none_got_one", "stage_unused_error", "unused_error"]


class UsedParams:
    """Which of ``trainable`` got a gradient since ``zero_grad()``, here and (``shared``: the marks
    all-reduced by :meth:`sync`) on any rank of ``group``."""

    def __init__(
        self, trainable: Sequence[tuple[str, nn.Parameter]], group: CommunicationBackend, shared: bool
    ) -> None:
        self._names = [n for n, _ in trainable]
        self._params = [p for _, p in trainable]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._group, self._shared = group, shared
        self._marks = [p.grad is not None for p in self._params]  # a .grad from before wrapping counts
        #: ids of the parameters whose gradient ``zero_grad(set_to_none=False)`` zeroed after they had one:
        #: torch steps them (with zeros) from then on, used or not, until a ``set_to_none=True``
        self._kept: frozenset[int] = frozenset()
        #: ids of the parameters without a gradient (no rank used them since ``zero_grad()``, none kept),
        #: as of the last synchronization or ``zero_grad()``: the same on every rank
        self.unused = self._unmarked()

    def marking(self, fn: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
        """``fn`` as a gradient hook that marks its parameter used first."""

        def hook(param: nn.Parameter) -> None:
            self._marks[self._index[id(param)]] = True
            fn(param)

        return hook

    def sync(self) -> None:
        """After a synchronization: the parameters no rank used since ``zero_grad()`` (collective)."""
        buf = torch.tensor(self._marks, dtype=torch.float64, device=self._group.device)
        self._group.all_reduce(buf, ReduceOp.MAX)
        self._marks = [bool(used) for used in buf.tolist()]
        self.unused = self._unmarked()

    def forget(self, param: nn.Parameter) -> None:
        """``param.grad`` was set to None outside ``zero_grad()`` (``model.zero_grad()`` under DDP) and
        ``param`` got no gradient since: none here, as in torch."""
        self._marks[self._index[id(param)]] = False
        self._kept -= {id(param)}

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad()``: with ``set_to_none=False`` what had a gradient keeps a zero one, as in torch
        (``shared``: on any rank as of the last synchronization, the same on every rank; else here)."""
        if set_to_none:
            self._kept = frozenset()
        else:
            had_none = self.unused if self._shared else self._unmarked()
            self._kept = frozenset(map(id, self._params)) - had_none
        self._marks = [False] * len(self._params)
        if self._shared:
            self.unused = self._unmarked()

    def unused_here(self) -> list[str]:
        """The names of the parameters that got no gradient on this rank since ``zero_grad()`` (nor keep
        a zero one from ``zero_grad(set_to_none=False)``): torch would leave their ``.grad`` None."""
        here = self._unmarked()
        return [n for n, p in zip(self._names, self._params, strict=True) if id(p) in here]

    def _unmarked(self) -> frozenset[int]:
        marks = zip(self._params, self._marks, strict=True)
        return frozenset(id(p) for p, used in marks if not used and id(p) not in self._kept)


def unused_error(who: str, rank: int, missing: list[str]) -> StrategyError:
    """The refusal of parameters that got no gradient in a synchronized backward."""
    return StrategyError(
        f"{who} on rank {rank}: parameters received no gradient in this backward pass: "
        f"{missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all). Every rank must "
        "reduce the same gradients or the job hangs; make them take part in the loss, freeze them "
        "(requires_grad=False) or pass find_unused_parameters=True to reduce zeros for them. If this "
        "backward is one of several over one forward (l1.backward(retain_graph=True); l2.backward()), "
        "add the losses and call backward() once: (l1 + l2).backward()"
    )


def none_got_one(err: StrategyError, who: str) -> StrategyError:
    """ZeRO-3/FSDP's :func:`unused_error` when no parameter got a gradient."""
    return StrategyError(
        f"{err}. No parameter got one: if this was torch.autograd.grad(loss, inputs) (an input "
        f"gradient), {who} does not support it, its parameters being gathered for one "
        "backward; DDPModel, ZeRO1Model and ZeRO2Model skip such a pass"
    )


def stage_unused_error(who: str, pp_rank: int, mine: list[str], per_rank: list[int]) -> StrategyError:
    """A pipeline step's refusal, raised on every pipeline rank: ``per_rank[r]`` parameters of pipeline
    rank ``r`` got no gradient from any micro-batch since ``zero_grad()`` (``mine``: this rank's)."""
    ranks = [r for r, n in enumerate(per_rank) if n]
    here = f"{mine[:10]}{' ...' if len(mine) > 10 else ''}" if mine else "none here"
    return StrategyError(
        f"{who} on pipeline rank {pp_rank}: {sum(per_rank)} parameters of pipeline rank(s) {ranks} "
        f"received no gradient from any micro-batch of this step ({here}; each rank names its own). "
        "Reduced, their zero gradients would be stepped (momentum and weight decay move them) where "
        "torch leaves their .grad None and skips them; make them take part in the loss, freeze them "
        "(requires_grad=False) or pass find_unused_parameters=True to leave them out of the step as "
        "torch does (one small all-reduce per step)"
    )
