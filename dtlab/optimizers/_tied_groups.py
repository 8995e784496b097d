"""A weight tied across pipeline stages must be stepped alike on every stage holding a copy.

A pipeline keeps one copy of a tied weight (the token embedding on the first stage, the LM head on the
last) per stage rank, and sums the copies' gradients (:mod:`dtlab.models.pipeline._ties`), so equal
updates keep them equal. The user's param groups are built per rank: if the copies land in groups with
different options (one in a group with its own ``lr``, the other in the weight-decay group), each copy is
stepped its own way and the weights drift apart silently, where one process steps ONE parameter in ONE
group. :func:`check_tied_groups` refuses that at the optimizer's build, on every rank alike (one
``all_gather_object`` over the whole world, only when the model has such ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dtlab.errors import StrategyError
from dtlab.models.base import OptimizerTarget
from dtlab.optimizers._groups import jsonable

__all__ = ["check_tied_groups"]

#: (the tie's first name, this copy's name, its group's options)
Copy = tuple[str, str, dict[str, Any]]


def _copies(model: OptimizerTarget, groups: Sequence[dict[str, Any]], aliases: dict[str, str]) -> list[Copy]:
    """This rank's copies of tied weights, each with its group's options."""
    tied = set(aliases) | set(aliases.values())
    names = {id(p): n for n, p in model.trainable_parameters() if n in tied}
    out: list[Copy] = []
    for g in groups:
        options = jsonable(g)  # comparable across ranks: a tensor lr as its value, betas as a list
        for p in g["params"]:
            if id(p) in names:
                n = names[id(p)]
                out.append((aliases.get(n, n), n, options))
    return out


def check_tied_groups(who: str, model: OptimizerTarget, groups: Sequence[dict[str, Any]]) -> None:
    """Raise on every rank, naming the copies and the options, when the copies of a weight tied across
    pipeline stages are in param groups with different options (a collective over the world when the
    model has such ties; none otherwise, alike on every rank)."""
    aliases = model.tied_names()
    if not aliases:
        return
    held: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    for rank, copies in enumerate(model.world_backend.all_gather_object(_copies(model, groups, aliases))):
        for first, name, options in copies:
            held.setdefault(first, []).append((rank, name, options))
    for first, copies in sorted(held.items()):
        keys = sorted({k for _, _, o in copies for k in o})
        differ = [k for k in keys if any(o.get(k) != copies[0][2].get(k) for _, _, o in copies)]
        if differ:
            where = "; ".join(
                f"{name!r} on rank {rank}: " + ", ".join(f"{k}={o.get(k)!r}" for k in differ)
                for rank, name, o in copies
            )
            raise StrategyError(
                f"{who}: {first!r} is one weight tied across pipeline stages, but its copies are in param "
                f"groups with different options ({where}), so each copy would be stepped its own way and "
                "they would drift apart; put both copies in groups with the same options (e.g. build the "
                "groups by the tie's names on every stage: model.tied_names() maps each copy's name to the "
                "first)"
            )
