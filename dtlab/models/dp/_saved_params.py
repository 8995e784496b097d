"""ZeRO-3's and FSDP's saved-tensor hooks, with the parameters a custom autograd Function saves itself.

What autograd saves while a unit is gathered is kept as a reference and re-gathered on unpack
(:class:`~dtlab.models.dp._sharded_units.UnitGatherer`). Torch hands ``ctx.saved_tensors`` back as a new
tensor built from what the unpack hook returns, never the parameter itself (as under ``save_on_cpu``):
a custom Function's ``backward`` writing ``weight.grad`` by hand (gradient-accumulation fusion) would
write it on that tensor and the gradient would be lost. So a trainable parameter saved by a custom
Function (not one of torch's or dtlab's own) comes back as a
:class:`~dtlab.core.saved_params.SavedParameter` (as under a pipeline's activation meter): the gathered
values (every operation runs on them) whose ``.grad`` is the parameter's, so the write lands in the
gradient the strategy reduces, before the parameter's gradient hook, as under DDP or in one process.
Tensors saved by torch's operations (views of a parameter, ``layer_norm``'s weight) are not affected.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dtlab.core.saved_params import SavedHooks, SavedParameter, custom_function_saves
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["SavedParameter", "SavedTensors"]


@dataclass(frozen=True)
class _ParamRef:
    """A trainable parameter a custom Function saved: the parameter object (never its gathered storage)."""

    unit: ShardUnit
    param: nn.Parameter


class SavedTensors:
    """The pack and unpack hooks of one ZeRO-3/FSDP model (``unit_of``: each trainable parameter's unit)."""

    def __init__(self, at_rest: UnitGatherer, unit_of: dict[int, ShardUnit]) -> None:
        self.at_rest = at_rest
        self.unit_of = unit_of
        #: the saved-tensor hooks these shadow in the forward running (``save_on_cpu()``, a non-reentrant
        #: checkpoint around the model or a pipeline stage, a pipeline's activation meter): the
        #: activations kept as they are go to them
        self.outer: SavedHooks | None = None

    def hooks(self, eager: bool) -> SavedHooks:
        """The pack and unpack hooks (``eager``, for a forward ``torch.compile`` traces: run eagerly, else
        dynamo compiles each call as a frame of its own, guarded on the saved tensor's id)."""
        if eager:
            return torch.compiler.disable(self.pack), torch.compiler.disable(self.unpack)
        return self.pack, self.unpack

    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook (called by autograd: frame 1 is the code that made it save ``t``)."""
        st = self.unit_of.get(id(t))  # the parameter itself (the ids of live objects differ)
        if st is None:
            return self.at_rest.pack(t, self.outer)
        if custom_function_saves(sys._getframe(1)):  # noqa: SLF001 - the saving frame
            return _ParamRef(st, cast(nn.Parameter, t))
        return self.at_rest.pack(t, self.outer)

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _ParamRef):  # normally gathered already by the pre-backward hook
            self.at_rest.gather(obj.unit)
            return SavedParameter(obj.param, obj.param.detach())
        return self.at_rest.unpack(obj)
