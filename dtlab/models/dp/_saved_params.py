"""ZeRO-3's and FSDP's saved-tensor hooks, with the parameters a custom autograd Function saves itself.

What autograd saves while a unit is gathered is kept as a reference and re-gathered on unpack
(:class:`~dtlab.models.dp._sharded_units.UnitGatherer`). Torch hands ``ctx.saved_tensors`` back as a new
tensor built from what the unpack hook returns, never the parameter itself (as under ``save_on_cpu``):
a custom Function's ``backward`` writing ``weight.grad`` by hand (gradient-accumulation fusion) would
write it on that tensor and the gradient would be lost. So a trainable parameter saved by a custom
Function (not one of torch's or dtlab's own) comes back as a :class:`SavedParameter`: the gathered
values (every operation runs on them) whose ``.grad`` is the parameter's, so the write lands in the
gradient the strategy reduces, before the parameter's gradient hook, as under DDP or in one process.
Tensors saved by torch's operations (views of a parameter, ``layer_norm``'s weight) are not affected.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["SavedParameter", "SavedTensors"]

_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_DETACH = torch.ops.aten.detach.default
_OWN = ("torch.", "dtlab.")  # Functions that never write a saved tensor's .grad (AOT's compiled ones, ...)


def _custom_function_saves(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the caller of the pack hook) is ``Function.apply`` of a user's Function."""
    if frame is None or frame.f_code is not _APPLY:
        return False
    cls = frame.f_locals.get("cls")
    return isinstance(cls, type) and not cls.__module__.startswith(_OWN)


def _unwrap(a: Any) -> Any:
    return a.elem if isinstance(a, SavedParameter) else a


class SavedParameter(torch.Tensor):
    """A sharded parameter as a custom Function's ``ctx.saved_tensors`` gives it back: the gathered values
    (``elem``, whose storage it shares; every operation runs on ``elem``), with ``.grad`` read and written
    on the parameter itself."""

    param: nn.Parameter
    elem: torch.Tensor
    __torch_function__: ClassVar[Any] = torch._C._disabled_torch_function_impl  # noqa: SLF001 - torch's API for a tensor subclass

    @staticmethod
    def __new__(cls, param: nn.Parameter, elem: torch.Tensor) -> SavedParameter:
        # a subclass over elem's storage (data_ptr() works: a Triton or C++ kernel reading it is served)
        out: SavedParameter = torch.Tensor._make_subclass(cls, elem)  # noqa: SLF001 - torch's API for a tensor subclass
        out.param, out.elem = param, elem
        return out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is _DETACH and isinstance(args[0], SavedParameter):  # torch wrapping the unpacked tensor
            return SavedParameter(args[0].param, args[0].elem)
        if kwargs or any(isinstance(a, list | tuple) for a in args):  # cat([...]), out=: the general walk
            return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        return func(*(a.elem if isinstance(a, SavedParameter) else a for a in args))

    @property
    def grad(self) -> torch.Tensor | None:
        return self.param.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self.param.grad = value

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self.elem!r})"


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
        #: the model's ``observe_activation`` for the forward running (a pipeline's activation meter)
        self.observe: Callable[[torch.Tensor], Any] | None = None

    def pack(self, t: torch.Tensor) -> Any:
        """The pack hook (called by autograd: frame 1 is the code that made it save ``t``)."""
        st = self.unit_of.get(id(t))  # the parameter itself (the ids of live objects differ)
        if st is not None and _custom_function_saves(sys._getframe(1)):  # noqa: SLF001 - the saving frame
            return _ParamRef(st, cast(nn.Parameter, t))
        return self.at_rest.pack(t, self.observe)

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _ParamRef):  # normally gathered already by the pre-backward hook
            self.at_rest.gather(obj.unit)
            return SavedParameter(obj.param, obj.param.detach())
        return self.at_rest.unpack(obj)
