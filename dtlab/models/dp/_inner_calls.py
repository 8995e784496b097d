"""A module inside a ZeRO-3/FSDP unit called on its own, outside the wrapper's forward (Hugging Face's
``model.get_input_embeddings()(input_ids)`` for ``inputs_embeds=``, under FSDP whose unit holding the
embedding is the whole model's or a decoder layer's). Only a unit's own module gathers it (its forward
pre-hook), so between forwards such a module reads its parameters' parked stand-ins and returned NaN,
silently. :class:`InnerCalls` puts a forward pre-hook on each such module that refuses the call while
it would read their stand-ins (its unit not gathered), naming the module, the unit and the fixes; with
the unit gathered (the wrapper's forward, ``summon_full_params()``, a direct forward of the unit's
module) or the tensors swapped (``functional_call``) it lets the call through. torch's FSDP2 refuses
such a call too (a sharded DTensor parameter); ZeRO-3, a unit per module, gathers it."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dtlab.errors import StrategyError
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["InnerCalls"]


class InnerCalls:
    """The refusal above on every module of ``module`` that owns parameters of a sharded unit it is not
    the module of."""

    def __init__(self, at_rest: UnitGatherer, module: nn.Module, who: str) -> None:
        self.at_rest, self.who = at_rest, who
        names = {id(m): n for n, m in module.named_modules()}
        heads = {id(g) for g, _ in at_rest.groups}
        unit_of = {
            id(p): (names.get(id(g), "?"), st)
            for g, sts in at_rest.groups
            for st in sts
            if not st.persistent
            for p in st.unit.params
        }
        for name, m in module.named_modules():
            owned = [unit_of[id(p)] for p in m.parameters(recurse=False) if id(p) in unit_of]
            if id(m) in heads or not owned:
                continue
            hook = partial(self._check, name, owned[0][0], [st for _, st in owned])
            m.register_forward_pre_hook(hook)

    def _check(self, name: str, unit: str, units: list[ShardUnit], module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():  # traced inside the wrapper's forward: gathered, nothing to trace
            return
        if all(st.flat is not None for st in units):  # gathered: the usual case, one check
            return
        parked = {st.unit.marker.untyped_storage().data_ptr() for st in units if st.unit.marker.numel()}
        if not any(p.untyped_storage().data_ptr() in parked for p in module.parameters(recurse=False)):
            return  # its tensors are not the stand-ins (swapped by functional_call: a pipeline's trace)
        torch_class = next((c for c in type(module).__mro__ if c.__module__.startswith("torch.nn")), None)
        base = type(module).__name__ if torch_class is None else f"nn.{torch_class.__name__}"
        where = f"the unit of {unit!r}" if unit else "the wrapped model's own unit"
        raise StrategyError(
            f"{self.who}: {name!r} ({type(module).__name__}) was called on its own, outside the wrapper's "
            f"forward, while its parameters are sharded in {where}, which only that module's forward "
            "gathers: it would read their empty stand-ins (NaN). Make it a unit of its own (add its class "
            f"to the wrap policy: ModuleClassPolicy((..., {base})); dtlab train: strategy.fsdp_units), as "
            "torch FSDP2's fully_shard(module) on it, or use ZeRO-3 (a unit per module); or call it inside "
            "the model's forward (pass input_ids rather than inputs_embeds)"
        )
