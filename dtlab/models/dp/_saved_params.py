"""ZeRO-3's and FSDP's saved-tensor hooks, with the parameters a custom autograd Function saves itself.

What autograd saves while a unit is gathered is kept as a reference and re-gathered on unpack. Torch hands
``ctx.saved_tensors`` back as a new tensor built from what the unpack hook returns, never the parameter itself
(as under ``save_on_cpu``): a custom Function's ``backward`` writing ``weight.grad`` by hand
(gradient-accumulation fusion) would write it on that tensor and the gradient would be lost. So a trainable
parameter saved by a custom Function (not one of torch's or dtlab's own) comes back as a
:class:`~dtlab.core.saved_params.SavedParameter` (as under a pipeline's activation meter): the gathered values
(every operation runs on them) whose ``.grad`` is the parameter's, so the write lands in the gradient the
strategy reduces, before the parameter's gradient hook, as under DDP or in one process. Tensors saved by
torch's operations (views of a parameter, ``layer_norm``'s weight) are not affected.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dtlab.core.saved_params import SavedHooks, SavedParameter, custom_function_saves
from dtlab.core.torch_private import copied_from
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["SavedParameter", "SavedTensors"]


@dataclass(frozen=True)
class _SavedRef:
    """A saved tensor that aliases a gathered buffer: re-gathered on unpack."""

    unit: ShardUnit
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _OuterSaved:
    """A saved tensor kept by the saved-tensor hooks these shadow: what their pack made of it, and
    their unpack."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


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
        """The pack hook (called by autograd: frame 1 is the code that made it save ``t``): a reference
        when ``t`` aliases a gathered buffer, else ``t`` detached, or what the :attr:`outer` hooks make
        of it. Detached: an operation saving its own output (tanh, softmax, attention) would otherwise
        hold its node through the output's ``grad_fn``, a cycle through autograd's C++ that Python's
        garbage collector never frees, so a forward with gradients and no backward kept its graph for
        ever (autograd rebuilds the saved tensor's history at unpack from what it recorded)."""
        st = self.unit_of.get(id(t))  # the parameter itself (the ids of live objects differ)
        if st is None:
            if t.dtype != self.one_dtype and self.copies_possible and (ref := self._cast_ref(t)) is not None:
                return ref
        elif custom_function_saves(sys._getframe(1)):  # noqa: SLF001 - the saving frame
            return _ParamRef(st, cast(nn.Parameter, t))
        st = None if t.numel() == 0 else self.at_rest.by_storage.get(t.untyped_storage().data_ptr())
        if st is None or st.persistent or st.flat is None or t.dtype != st.flat.dtype:
            if self.outer is not None:
                return _OuterSaved(self.outer[0](t), self.outer[1])
            return t.detach() if t.requires_grad else t  # without grad: no grad_fn, so no cycle
        return _SavedRef(st, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

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
        if isinstance(obj, _SavedRef):  # normally gathered already by the pre-backward hook
            return self.at_rest.gather(obj.unit).as_strided(obj.size, obj.stride, obj.offset)
        if isinstance(obj, _CastRef):
            self.at_rest.gather(obj.unit)
            return obj.param.detach().to(obj.dtype).as_strided(obj.size, obj.stride, obj.offset)
        if isinstance(obj, _ParamRef):
            self.at_rest.gather(obj.unit)
            return SavedParameter(obj.param, obj.param.detach())
        if isinstance(obj, _OuterSaved):
            return obj.unpack(obj.packed)
        return cast(torch.Tensor, obj)
