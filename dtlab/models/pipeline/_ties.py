"""A weight tied across pipeline stages (GPT-2's ``wte`` on the first stage, ``lm_head`` on the last),
kept tied as Megatron-LM keeps its embedding (docs/your_model.md, "Tied weights across stages"): every
pipeline rank using it holds a copy, the copies start equal (a broadcast from the first of them over
their *tie group*), and their gradients are summed over the tie group before the optimizer step, so
identical updates keep them bitwise equal (when the sum comes, before or after the dp reduction:
:class:`~dtlab.models.compose._tied.TiedSync`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp

__all__ = ["CrossTie", "cross_ties", "init_ties", "rebind_ties", "sum_tied"]


@dataclass
class CrossTie:
    """One parameter used by stages on several pipeline ranks."""

    names: list[str]  #: its names in the whole model (the first is the one checkpoints store)
    ranks: list[int]  #: the pipeline ranks holding a copy, in order
    group: CommunicationBackend | None = None  #: over ``ranks`` (None on other ranks)
    param: nn.Parameter | None = None  #: this rank's copy


def cross_ties(module: nn.Module, holders: Mapping[int, Set[int]]) -> list[CrossTie]:
    """The parameters that stages on more than one pipeline rank hold (``holders``: a stage parameter's
    id -> the pipeline ranks whose stages hold it; a weight shared by two layers, or a layer in two
    blocks), each under every name it has in ``module`` (while whole), in ``module``'s order."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [CrossTie(n, sorted(holders[i])) for i, n in names.items() if len(holders.get(i, ())) > 1]


def init_ties(ties: Sequence[CrossTie], module: nn.Module, pp: CommunicationBackend, on_meta: bool) -> None:
    """Collective over ``pp`` (before other ranks' stages are released): each tie's group, this rank's
    copy, and the copies made equal to the first one's values. A model built on the meta device has no
    values yet: its copies are made equal by the meta construction, which initializes a tied parameter
    once, from its first module, on every rank alike (no broadcast). A ``.grad`` left from before
    wrapping stays on the first copy only, so the sum over the tie group counts it once."""
    for tie in ties:
        group = pp if len(tie.ranks) == pp.world_size else pp.new_group(tie.ranks)
        if pp.rank not in tie.ranks:
            continue
        tie.group = group
        tie.param = dict(module.named_parameters(remove_duplicate=False))[tie.names[0]]
        if group is not None and group.rank:  # a .grad left from before wrapping counts once: the first's
            tie.param.grad = None
        if group is not None and not on_meta:
            with torch.no_grad():
                group.broadcast(tie.param.data, 0)


def rebind_ties(ties: Sequence[CrossTie], root: nn.Module) -> None:
    """Each copy as ``root`` now holds it (a strategy built from the meta device gives its parameters
    new objects)."""
    held = dict(root.named_parameters(remove_duplicate=False))
    for tie in ties:
        if tie.param is not None:
            tie.param = next((held[n] for n in tie.names if n in held), tie.param)


def sum_tied(ties: Sequence[CrossTie], grads: Sequence[torch.Tensor | None]) -> None:
    """Replace each copy's gradient by the sum over its tie group (``grads[i]`` of ``ties[i]``; None: a
    copy that got no gradient, which contributes zeros)."""
    for tie, g in zip(ties, grads, strict=True):
        if tie.group is None or tie.param is None:
            continue
        buf = torch.zeros_like(tie.param) if g is None else g
        tie.group.all_reduce(buf, ReduceOp.SUM)
        if g is None:
            tie.param.grad = buf
