"""Trainable parameters added to a module after a data-parallel strategy wrapped it.

A strategy lays out its gradient hooks, buckets and shards for the parameters the module has when it is
wrapped. A parameter added later (a LoRA adapter put around a layer of ``model.module``, a new head, a
parametrization's ``original``) has none of them: its gradient is never averaged over the ranks and the
optimizer strategy, built on the wrapper's parameters, never steps it, so training would go on silently
without it. :class:`WrappedParams` records what was there and refuses a step while a trainable
parameter is not.
"""

from __future__ import annotations

from torch import nn

from dtlab.errors import StrategyError

__all__ = ["WrappedParams"]


class WrappedParams:
    """The parameters of ``module`` when the strategy ``who`` wrapped it (by identity)."""

    def __init__(self, who: str, module: nn.Module, shards_at_rest: bool) -> None:
        self.who = who
        self._module = module
        self._ids = {id(p) for p in module.parameters()}
        self._shards_at_rest = shards_at_rest

    def check(self) -> None:
        """Refuse, naming them, trainable parameters of the module that were not there at wrapping."""
        ids = self._ids
        if all(id(p) in ids or not p.requires_grad for p in self._module.parameters()):
            return
        added = [n for n, p in self._module.named_parameters() if p.requires_grad and id(p) not in ids]
        fresh = (
            "; the wrapped module holds shards, so load the wrapper's full_state_dict() (every rank) into a "
            "fresh plain module, add them there and wrap that"
            if self._shards_at_rest
            else ", or build a new wrapper and optimizer strategy on the module after adding them"
        )
        raise StrategyError(
            f"{self.who}: trainable parameters were added to the module after wrapping it: {added[:5]}"
            f"{' ...' if len(added) > 5 else ''} ({len(added)} in all; a LoRA adapter or a new layer put "
            "into model.module, or a parametrization registered after wrapping). The strategy averages and "
            "steps the parameters the module had when it was wrapped, so these would train on each rank's "
            f"own gradient or not at all. Add them to the plain module before wrapping it (freeze the base "
            f"weights there too){fresh}"
        )
