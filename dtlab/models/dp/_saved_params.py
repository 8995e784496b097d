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

Under ``torch.autocast`` an operation saves the low-precision copy of a weight it was handed, not the
gathered buffer: kept, every unit's copy would be held from the forward to the backward (the whole model
in bfloat16 on every rank, where the units themselves are freed). So a saved copy of a sharded
parameter is kept as a reference too, cast again from the re-gathered parameter at unpack (the same
values); autocast's cache of cast weights is cleared as each unit is freed after its forward (it held
every unit's copy until the autocast block ended: the forward's peak was the whole model, also under
``torch.no_grad()``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dtlab.core.saved_params import SavedHooks, SavedParameter, custom_function_saves
from dtlab.core.torch_private import copied_from
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["SavedParameter", "SavedTensors"]


@dataclass(frozen=True)
class _ParamRef:
    """A trainable parameter a custom Function saved: the parameter object (never its gathered storage)."""

    unit: ShardUnit
    param: nn.Parameter


@dataclass(frozen=True)
class _CastRef:
    """A saved copy of a sharded parameter in another dtype (autocast's), or a view of one: cast again
    from the gathered parameter at unpack."""

    unit: ShardUnit
    param: nn.Parameter
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class SavedTensors:
    """The pack and unpack hooks of one ZeRO-3/FSDP model (``unit_of``: each trainable parameter's unit)."""

    def __init__(self, at_rest: UnitGatherer, unit_of: dict[int, ShardUnit]) -> None:
        self.at_rest = at_rest
        self.unit_of = unit_of
        #: the one dtype of every sharded unit, else None: a saved tensor of that dtype is no copy of a
        #: sharded parameter in another dtype (most saved tensors, without autocast), so it is not looked at;
        #: nor is any when every unit stays gathered (persistent: small parameters)
        dtypes = {st.unit.dtype for st in unit_of.values() if not st.persistent}
        self.one_dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        self.copies_possible = bool(dtypes)
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
            if t.dtype == self.one_dtype or not self.copies_possible:  # _cast_ref's answer would be None
                return self.at_rest.pack(t, self.outer)
            return self._cast_ref(t) or self.at_rest.pack(t, self.outer)
        if custom_function_saves(sys._getframe(1)):  # noqa: SLF001 - the saving frame
            return _ParamRef(st, cast(nn.Parameter, t))
        return self.at_rest.pack(t, self.outer)

    def _cast_ref(self, t: torch.Tensor) -> _CastRef | None:
        """``t`` as a reference when it is (a view of) a copy of a gathered parameter in another dtype."""
        found = copied_from(t)
        st = None if found is None else self.unit_of.get(id(found[0]))
        if found is None or st is None or st.persistent or st.flat is None:
            return None
        param, copy = found
        if copy.shape != param.shape or copy.dtype == param.dtype or copy.device != param.device:
            return None
        if not (copy.is_contiguous() and param.is_contiguous() and copy.storage_offset() == 0):
            return None
        size, stride = tuple(t.size()), tuple(t.stride())
        return _CastRef(st, cast(nn.Parameter, param), copy.dtype, size, stride, int(t.storage_offset()))

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _CastRef):
            self.at_rest.gather(obj.unit)
            return obj.param.detach().to(obj.dtype).as_strided(obj.size, obj.stride, obj.offset)
        if isinstance(obj, _ParamRef):  # normally gathered already by the pre-backward hook
            self.at_rest.gather(obj.unit)
            return SavedParameter(obj.param, obj.param.detach())
        return self.at_rest.unpack(obj)
