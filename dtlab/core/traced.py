"""Code that must not be traced by ``torch.compile`` (a collective, a check read on the host) run
eagerly inside a compiled forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch

__all__ = ["eager_when_traced"]

F = TypeVar("F", bound=Callable[..., object])


def eager_when_traced(fn: F) -> F:
    """``fn``, or while ``torch.compile`` traces, ``fn`` under ``torch.compiler.disable``: one graph
    break, ``fn`` run eagerly. Wrapped at each call, never cached on an object (a wrapper cached by one
    compiled model was misread by a second)."""
    return cast(F, torch.compiler.disable(fn)) if torch.compiler.is_compiling() else fn
