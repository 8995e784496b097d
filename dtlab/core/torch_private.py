"""The one place dtlab reads torch's private attributes and functions: what torch keeps and lists
nowhere public (its hook dicts, which buffers are left out of a ``state_dict``, the saved-tensor hook
stack). Every other file reads them through these, so a torch release that renames one is fixed here."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any, cast

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

__all__ = [
    "global_optimizer_step_pre_hooks",
    "compiled_inside",
    "copied_from",
    "in_backward",
    "in_checkpoint_forward",
    "MODULE_HOOKS",
    "module_children",
    "OPTIMIZER_HOOKS",
    "TENSOR_HOOKS",
    "non_persistent_buffers",
    "op_arguments",
    "quiet_scheduler_checks",
    "tensor_version",
    "top_dispatch_mode",
    "top_saved_tensor_hooks",
    "unhooked_step",
]

#: where torch keeps the hooks: each registering call -> a reader of the hooks it added to a module or
#: a tensor (a dict by handle id; a tensor's is None before its first); every check of a user's hooks
#: reads them through these
MODULE_HOOKS: dict[str, Callable[[Any], dict[int, Any]]] = {
    "register_forward_pre_hook": attrgetter("_forward_pre_hooks"),
    "register_forward_hook": attrgetter("_forward_hooks"),
    "register_full_backward_pre_hook": attrgetter("_backward_pre_hooks"),
    "register_full_backward_hook": attrgetter("_backward_hooks"),
}
TENSOR_HOOKS: dict[str, Callable[[Any], dict[int, Any] | None]] = {
    "register_hook": attrgetter("_backward_hooks"),
    "register_post_accumulate_grad_hook": attrgetter("_post_accumulate_grad_hooks"),
}

#: the same for a torch optimizer's own hooks (``torch.optim.Optimizer.register_*_hook``)
OPTIMIZER_HOOKS: dict[str, Callable[[Any], dict[int, Any]]] = {
    "register_step_pre_hook": attrgetter("_optimizer_step_pre_hooks"),
    "register_step_post_hook": attrgetter("_optimizer_step_post_hooks"),
    "register_state_dict_pre_hook": attrgetter("_optimizer_state_dict_pre_hooks"),
    "register_state_dict_post_hook": attrgetter("_optimizer_state_dict_post_hooks"),
    "register_load_state_dict_pre_hook": attrgetter("_optimizer_load_state_dict_pre_hooks"),
    "register_load_state_dict_post_hook": attrgetter("_optimizer_load_state_dict_post_hooks"),
}


def unhooked_step(optimizer: Any) -> Callable[[], Any]:
    """``optimizer.step`` without the hooks torch wraps around it (the global ones of
    ``torch.optim.optimizer.register_optimizer_step_*_hook`` and the instance's): torch marks the
    wrapped ``step`` of a class ``hooked`` and keeps the unwrapped one as ``__wrapped__``."""
    step = type(optimizer).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        return cast("Callable[[], Any]", optimizer.step)
    return partial(inner, optimizer)


def quiet_scheduler_checks(optimizer: Any, step: Callable[..., Any]) -> None:
    """torch's LR schedulers wrap ``optimizer.step`` and warn at their first step when it was replaced
    since (their wrapper is marked ``_wrapped_by_lr_sched``) or never called (``optimizer._opt_called``):
    mark ``step``, the replacement, and ``optimizer`` as stepped (another object steps for it)."""
    setattr(step, "_wrapped_by_lr_sched", True)  # noqa: B010 - torch's marker on a function
    setattr(optimizer, "_opt_called", True)  # noqa: B010 - torch's flag on the optimizer


def non_persistent_buffers(module: nn.Module) -> frozenset[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (left out of its
    ``state_dict``; torch's ``_non_persistent_buffers_set``)."""
    return frozenset(getattr(module, "_non_persistent_buffers_set", ()))


def module_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own children by name, the live dict (torch's ``_modules``; ``children()`` walks it
    in Python, a generator per call)."""
    return cast("dict[str, nn.Module | None]", vars(module)["_modules"])


def tensor_version(t: torch.Tensor) -> int:
    """How many times ``t``'s data was changed in place (torch's version counter, ``_version``)."""
    return int(getattr(t, "_version"))  # noqa: B009 - torch's private counter


def op_arguments(op: Any) -> list[Any]:
    """The arguments of a torch operator overload (``torch.ops.aten.randn.default``) as its schema
    declares them, each with ``name``, ``type``, ``kwarg_only`` and ``default_value`` (torch's
    ``OpOverload._schema``)."""
    return list(attrgetter("_schema")(op).arguments)


def global_optimizer_step_pre_hooks() -> list[Callable[..., Any]]:
    """The hooks ``torch.optim.optimizer.register_optimizer_step_pre_hook`` registered in this process
    (torch keeps them in ``_global_optimizer_pre_hooks``; empty where a torch release lacks it)."""
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})
    return list(hooks.values())


def compiled_inside(module: nn.Module) -> bool:
    """Whether ``module`` is or holds a compiled module: ``torch.compile(m)``'s wrapper (an
    ``OptimizedModule``) or one compiled in place (``m.compile()``: torch's ``_compiled_call_impl``)."""
    return any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def in_backward() -> bool:
    """Whether a backward pass runs on this thread now (torch's graph task id; -1 outside any)."""
    return bool(torch._C._current_graph_task_id() != -1)  # noqa: SLF001 - torch's query (torch.utils.checkpoint uses it)


def in_checkpoint_forward() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant ``torch.utils.checkpoint``'s: its
    forward is running, and what it would save is recomputed in backward (where no torch function mode
    of the forward is active)."""
    hooks = top_saved_tensor_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def top_dispatch_mode() -> object | None:
    """The innermost torch dispatch mode active on this thread (the next to see an op), or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def top_saved_tensor_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost saved-tensor hooks active now, ``(pack, unpack)`` (``save_on_cpu()``, a
    non-reentrant checkpoint's, ...), or None; torch's ``_top_saved_tensors_default_hooks`` (None where
    a torch release lacks it: dtlab then sees no outer hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # noqa: SLF001 - torch's saved-tensor hook stack
    hooks = top(False) if top is not None else None
    return None if hooks is None else (hooks[0], hooks[1])


def copied_from(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(leaf, copy)`` when ``t`` is ``copy`` or a view of it, and ``copy`` a copy autograd records of
    the leaf tensor ``leaf`` (``leaf.to(dtype)``: what ``torch.autocast`` hands an operation for a
    float32 weight); else None. Reads the view's ``_base`` and autograd's node name
    (``ToCopyBackward0``) and its ``AccumulateGrad`` node's ``variable``."""
    copy = t._base if t._base is not None else t  # noqa: SLF001 - the tensor a view was made of
    fn = copy.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    leaf = getattr(fn.next_functions[0][0], "variable", None)
    return (leaf, copy) if isinstance(leaf, torch.Tensor) else None
