"""A trainable parameter a user's custom autograd Function saves itself, under saved-tensor hooks.

With saved-tensor hooks active (ZeRO-3/FSDP's, a pipeline's activation meter), torch hands
``ctx.saved_tensors`` back as a new tensor built from what the unpack hook returns, never the parameter
itself (as under ``save_on_cpu``): a custom Function's ``backward`` writing ``weight.grad`` by hand
(gradient-accumulation fusion) would write it on that tensor and the gradient would be lost. Such a
parameter (saved by a Function that is not one of torch's or dtlab's own: :func:`custom_function_saves`)
comes back as a :class:`SavedParameter`: the parameter's values (every operation runs on them) whose
``.grad`` is the parameter's, so the write lands where the strategy's gradient hook reads it, as in one
process.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dtlab.core.torch_private import top_saved_tensor_hooks
from dtlab.core.traced import eager_when_traced

__all__ = ["SavedHooks", "SavedParameter", "custom_function_saves", "outer_saved_hooks"]

#: a pair of saved-tensor hooks, ``(pack, unpack)``
SavedHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_DETACH = torch.ops.aten.detach.default
_OWN = ("torch.", "dtlab.")  # Functions that never write a saved tensor's .grad (AOT's compiled ones, ...)


def custom_function_saves(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the caller of a pack hook) is ``Function.apply`` of a user's Function; the
    frames of ``torch.compiler.disable``'s wrapper (a hook run eagerly under ``torch.compile``) between
    them are looked past."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch._dynamo"):
        frame = frame.f_back
    if frame is None or frame.f_code is not _APPLY:
        return False
    cls = frame.f_locals.get("cls")
    return isinstance(cls, type) and not cls.__module__.startswith(_OWN)


def outer_saved_hooks() -> SavedHooks | None:
    """The saved-tensor hooks active now (torch's innermost: ``save_on_cpu()``, a non-reentrant
    checkpoint's, a pipeline's activation meter), which hooks pushed next would shadow; None if none.
    Read eagerly inside a compiled forward (dynamo cannot trace torch's reader: it warned)."""
    return eager_when_traced(top_saved_tensor_hooks)()


def _unwrap(a: Any) -> Any:
    return a.elem if isinstance(a, SavedParameter) else a


class SavedParameter(torch.Tensor):
    """A parameter as a custom Function's ``ctx.saved_tensors`` gives it back under saved-tensor hooks:
    its values (``elem``, whose storage it shares; every operation runs on ``elem``; ZeRO-3/FSDP: the
    gathered values), with ``.grad`` read and written on the parameter itself."""

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
