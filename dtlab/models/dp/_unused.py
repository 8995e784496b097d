"""Parameters no rank computed a gradient for (``find_unused_parameters=True``), and backward passes
that fill no ``.grad`` (:func:`grads_filled`).

torch's optimizers skip a parameter whose ``.grad`` is None: no momentum, no weight decay, no Adam
step. One process leaves that ``.grad`` None (after ``zero_grad()``) for a parameter its loss did not
reach, and so does torch's DDP when no rank reached it (it all-reduces a map of the parameters each rank
used). The strategies reduce zeros for such a parameter; :class:`UsedParams` marks the parameters that
got a gradient on this rank since ``zero_grad()`` and, after each synchronization, all-reduces the marks
(MAX, one float64 per trainable parameter), so the optimizer strategy leaves out those no rank used.

Without ``find_unused_parameters`` the marks stay local: gradients accumulated inside ``no_sync()``
and reduced at once, by a pipeline's step or by ``reduce_accumulated_grads()`` called by the user, are
refused before reducing when a parameter got none since ``zero_grad()`` (:meth:`UsedParams.unused_here`)
rather than stepped with zeros: on every rank of a pipeline and of its dp replicas
(:func:`everywhere_unused_error`, the counts carried by the loss's all-reduce over pp, then over dp), on
every rank of the dp group (:meth:`UsedParams.refuse_unused`, one all-reduce of a count per rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError

__all__ = [
    "UsedParams",
    "autograd_grad_message",
    "everywhere_unused_error",
    "grads_filled",
    "none_got_one",
    "unused_error",
]


class UsedParams:
    """Which of ``trainable`` got a gradient since ``zero_grad()``, here and (``shared``: the marks
    all-reduced by :meth:`sync`) on any rank of ``group``."""

    def __init__(
        self, trainable: Sequence[tuple[str, nn.Parameter]], group: CommunicationBackend, shared: bool
    ) -> None:
        self._names = [n for n, _ in trainable]
        self._params = [p for _, p in trainable]
        self._order = list(map(id, self._params))
        self._ids = frozenset(self._order)
        self._group, self._shared = group, shared
        #: ids of the parameters marked used (a .grad from before wrapping counts)
        self._used = {id(p) for p in self._params if p.grad is not None}
        #: ids of the parameters whose gradient ``zero_grad(set_to_none=False)`` zeroed after they had one:
        #: torch steps them (with zeros) from then on, used or not, until a ``set_to_none=True``
        self._kept: frozenset[int] = frozenset()
        #: ids of the parameters without a gradient (no rank used them since ``zero_grad()``, none kept),
        #: as of the last synchronization or ``zero_grad()``: the same on every rank
        self.unused = self._unmarked()

    def marking(self, fn: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
        """``fn`` as a gradient hook that marks its parameter used first."""

        def hook(param: nn.Parameter) -> None:
            self._used.add(id(param))
            fn(param)

        return hook

    def sync(self) -> None:
        """After a synchronization: the parameters no rank used since ``zero_grad()`` (collective)."""
        marks = list(map(self._used.__contains__, self._order))
        buf = torch.tensor(marks, dtype=torch.float64, device=self._group.device)
        self._group.all_reduce(buf, ReduceOp.MAX)
        self._used = set(compress(self._order, buf.tolist()))
        self.unused = self._unmarked()

    def forget(self, param: nn.Parameter) -> None:
        """``param.grad`` was set to None outside ``zero_grad()`` (``model.zero_grad()`` under DDP) and
        ``param`` got no gradient since: none here, as in torch."""
        self._used.discard(id(param))
        self._kept -= {id(param)}

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad()``: with ``set_to_none=False`` what had a gradient keeps a zero one, as in torch
        (``shared``: on any rank as of the last synchronization, the same on every rank; else here)."""
        if set_to_none:
            self._kept = frozenset()
        else:
            had_none = self.unused if self._shared else self._unmarked()
            self._kept = self._ids - had_none
        self._used = set()
        if self._shared:
            self.unused = self._unmarked()

    def unused_here(self, whole_grads: bool) -> list[str]:
        """The names of the parameters that got no gradient on this rank since ``zero_grad()`` (nor keep
        a zero one from ``zero_grad(set_to_none=False)``): torch would leave their ``.grad`` None.
        ``whole_grads`` (DDP, ZeRO-1: ``zero_grad()`` points ``.grad`` into the bucket and a backward
        puts it back there): a ``.grad`` of None was set to None since (``model.zero_grad()``), and no
        backward gave one after, so it is none either, marked or not."""
        here = self._unmarked()
        return [
            n
            for n, p in zip(self._names, self._params, strict=True)
            if id(p) in here or (whole_grads and p.grad is None)
        ]

    def refuse_unused(self, who: str, whole_grads: bool, checks: Sequence[Callable[[], None]]) -> None:
        """Before reducing gradients accumulated inside ``no_sync()`` without ``find_unused_parameters``:
        refuse on every rank of the group when any rank holds a parameter without a gradient
        (:meth:`unused_here`), each naming its own, after ``checks`` (which may raise a more precise
        error: a parameter frozen after wrapping). Collective: one all-reduce of a float32 per rank, so
        ranks that disagree (a parameter skipped on some only) all refuse instead of some waiting in the
        reduction."""
        mine = self.unused_here(whole_grads)
        counts = torch.zeros(self._group.world_size, dtype=torch.float32, device=self._group.device)
        counts[self._group.rank] = len(mine)
        if self._group.world_size > 1:
            self._group.all_reduce(counts)
        per_rank = [int(c) for c in counts.tolist()]
        if any(per_rank):
            for check in checks:
                check()
            where = f"{who}.reduce_accumulated_grads() on rank {self._group.rank}"
            since = "from any backward since zero_grad()"
            raise everywhere_unused_error(where, "rank(s)", since, mine, dict(enumerate(per_rank)))

    def _unmarked(self) -> frozenset[int]:
        return self._ids - self._used - self._kept


#: the flag as a refusal names it, in Python and in a ``dtlab train`` config
FLAG = "pass find_unused_parameters=True (dtlab train: strategy.find_unused_parameters=true)"


def unused_error(who: str, rank: int, missing: list[str]) -> StrategyError:
    """The refusal of parameters that got no gradient in a synchronized backward."""
    return StrategyError(
        f"{who} on rank {rank}: parameters received no gradient in this backward pass: "
        f"{missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)} in all). Every rank must "
        "reduce the same gradients or the job hangs; make them take part in the loss, freeze them "
        f"(requires_grad=False) or {FLAG} to leave those no rank used out of the step, as torch's DDP. "
        "If this backward is one of several over one forward (l1.backward(retain_graph=True); "
        "l2.backward()), add the losses and call backward() once: (l1 + l2).backward()"
    )


def none_got_one(err: StrategyError, who: str) -> StrategyError:
    """ZeRO-3/FSDP's :func:`unused_error` when no parameter got a gradient."""
    return StrategyError(
        f"{err}. No parameter got one: if this was torch.autograd.grad(loss, inputs) with "
        f"create_graph=True (a gradient penalty on the inputs), {who} does not support it, its "
        "parameters being gathered for one backward (without create_graph, an input gradient works); "
        "DDPModel, ZeRO1Model and ZeRO2Model skip such a pass"
    )


def everywhere_unused_error(
    where: str, ranks_are: str, since: str, mine: list[str], per_rank: Mapping[object, int]
) -> StrategyError:
    """A refusal raised on every rank of a group before anything is reduced (a pipeline step, over pp
    and dp; ``reduce_accumulated_grads()``, over dp): ``per_rank[r]`` parameters of the group's rank
    ``r`` got no gradient ``since`` (``mine``: this rank's); ``where``: the call and this rank;
    ``ranks_are``: what the group's ranks (the keys of ``per_rank``) are called."""
    ranks = [r for r, n in per_rank.items() if n]
    here = f"{mine[:10]}{' ...' if len(mine) > 10 else ''}" if mine else "none here"
    return StrategyError(
        f"{where}: {sum(per_rank.values())} parameters of {ranks_are} {ranks} received no gradient {since} "
        f"({here}; each rank names its own); nothing was reduced. Reduced, their zero gradients would "
        "be stepped (momentum and weight decay move them) where torch leaves their .grad None and skips "
        "them; make them take part in the loss, freeze them (requires_grad=False) before wrapping, or "
        f"{FLAG} to leave out of the step those no rank used, as torch does (one small all-reduce per step)"
    )


def grads_filled(params: Iterable[torch.Tensor]) -> bool | None:
    """Called inside a backward: whether it accumulates into the ``.grad`` of the first parameter for
    which the answer is not False. True in a backward that accumulates; None inside
    ``torch.autograd.grad`` asked for that parameter (torch's engine refuses the question for a leaf it
    hands a gradient back for); False for none: an input gradient (``torch.autograd.grad(loss, x)``, an
    adversarial step: nothing to reduce), or the outer pass of a model whose parameters are all in
    reentrant checkpoints (their nested backwards fill them). One answer settles it: no ``.grad`` is
    accumulated inside ``torch.autograd.grad``, so both cannot occur in one pass.

    A gradient penalty takes ``torch.autograd.grad(loss, params, create_graph=True)`` first, then calls
    ``backward()`` on a loss built from those gradients: the first pass fills no ``.grad`` (the engine
    hands the gradients back), so a strategy has nothing to reduce in it; the second is the one to
    synchronize."""
    will_run = torch._C._will_engine_execute_node  # noqa: SLF001 - torch's engine query (as its FSDP uses)
    for p in params:
        if p.requires_grad:  # one frozen after wrapping is refused elsewhere, naming requires_grad
            try:
                if will_run(get_gradient_edge(p).node):
                    return True
            except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
                return None
    return False


def autograd_grad_message(model: str, rank: int) -> str:
    """The refusal of ``torch.autograd.grad`` through a strategy that gathers its parameters per use."""
    return (
        f"{model} on rank {rank}: torch.autograd.grad() asked for gradients of the model's parameters (a "
        "gradient penalty?). It fills no .grad, and this strategy's parameters are gathered for one "
        "backward and freed, so a second backward through create_graph=True gradients cannot reach them. "
        "Use DDPModel, ZeRO1Model or ZeRO2Model for gradient penalties (they skip the autograd.grad pass "
        "and synchronize the backward() after it), or compute the gradient with loss.backward()"
    )
