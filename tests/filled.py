"""Parameter values for the tests' small models, drawn from a generator of their own: never torch's
global RNG, which in-memory ranks (threads) share and the suite's random order would reorder."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def filled(module: M, seed: int, *, scale: float = 1.0, shift: float = 0.0) -> M:
    """``module`` with every parameter, in registration order, ``randn * scale + shift`` (float32
    draws) from ``torch.Generator().manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            values = torch.randn(p.shape, generator=g) * scale
            p.copy_(values + shift if shift else values)
    return module
