"""The one place dtlab reads torch's private attributes of modules and tensors: what torch keeps and
lists nowhere public (its hook dicts, which buffers are left out of a ``state_dict``). Every other
file reads them through these, so a torch release that renames one is fixed here."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from torch import nn

__all__ = ["MODULE_HOOKS", "TENSOR_HOOKS", "non_persistent_buffers"]

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


def non_persistent_buffers(module: nn.Module) -> frozenset[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (left out of its
    ``state_dict``; torch's ``_non_persistent_buffers_set``)."""
    return frozenset(getattr(module, "_non_persistent_buffers_set", ()))
