"""Flat, padded parameter buffers: the layout DDP buckets, ZeRO shards and FSDP units share.

A :class:`FlatUnit` lays some parameters end to end in one flat buffer of ``padded`` elements (a
multiple of the world size ``P``); rank ``r`` owns elements ``[r*c, (r+1)*c)`` with ``c = padded/P``.
The parameters become views into the buffer (``bind``), so the module computes on it directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from dtlab.errors import StrategyError

__all__ = ["FlatUnit", "Slot", "check_real", "copy_grad", "reshaped_error"]


def copy_grad(view: torch.Tensor, grad: torch.Tensor) -> None:
    """Write ``grad`` into ``view`` (a parameter's place in a flat buffer, in its shape). A sparse
    gradient (``nn.Embedding(sparse=True)``) is added into zeros: the buffers are dense."""
    if grad.layout == torch.strided:
        view.copy_(grad)
    else:
        view.zero_().add_(grad)


def reshaped_error(who: str, name: str, now: torch.Size, was: torch.Size) -> StrategyError:
    """The error for parameter ``name`` of shape ``now`` where the strategy ``who`` laid it out with
    shape ``was`` when it wrapped the module: its ``.data`` was replaced by a tensor of another shape."""
    return StrategyError(
        f"{who}: parameter {name!r} had its .data replaced (p.data = t) after wrapping by a tensor of shape "
        f"{tuple(now)}, not its {tuple(was)} (Hugging Face's resize_token_embeddings(n) on the wrapped model "
        "does this to the embedding and the head); the strategy laid out its gradient buffers and shards "
        "for the shapes at wrapping, so it could not average or step it: resize the plain model before "
        "wrapping it (hf_model.resize_token_embeddings(n), then wrap), as any other change of shape; to "
        "write values keep the parameter's shape (p.data = t or, better, with torch.no_grad(): p.copy_(t))"
    )


def check_real(who: str, trainable: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Refuse complex trainable parameters: the engines reduce real dtypes only."""
    found = [f"{n!r} ({p.dtype})" for n, p in trainable if p.is_complex()]
    if found:
        raise StrategyError(
            f"{who}: {', '.join(found[:5])}{' ...' if len(found) > 5 else ''} holds complex numbers, whose "
            "gradient dtlab's communication engines cannot reduce (they move real dtypes). Store it "
            "as real pairs and view it as complex in forward: self.w = nn.Parameter(torch.view_as_real(w)), "
            "then torch.view_as_complex(self.w) (torch's optimizers step a complex parameter as such pairs)"
        )


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in its unit's flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int


class FlatUnit:
    """Parameters laid end to end in one flat buffer padded to a multiple of ``world_size``."""

    def __init__(
        self, key: str, named_params: list[tuple[str, nn.Parameter]], world_size: int, rank: int
    ) -> None:
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{n}: {p.dtype}" for n, p in named_params)
            raise StrategyError(
                f"unit {key!r} mixes parameter dtypes ({listing}); one flat buffer needs one dtype: "
                "cast the module (module.to(dtype)) or put the differently typed parameters in their own unit"
            )
        self.key = key
        self.params = [p for _, p in named_params]
        self.dtype = named_params[0][1].dtype
        self.device = named_params[0][1].device
        self.rank = rank
        starts = list(accumulate((p.numel() for _, p in named_params), initial=0))
        self.slots = [
            Slot(n, p.shape, at, p.numel()) for (n, p), at in zip(named_params, starts[:-1], strict=True)
        ]
        self.numel = starts[-1]
        self.shard_numel = max(1, -(-self.numel // world_size))
        self.padded = self.shard_numel * world_size
        #: while parked, one element per parameter under its stand-in (see :meth:`park`)
        self.marker = torch.empty(0, dtype=self.dtype, device=self.device)
        #: each parameter's data pointer as the last bind/park/unbind left it: another means ``p.data = t``
        self.ptrs: list[int] = []

    def shard_bounds(self) -> tuple[int, int]:
        """This rank's elements ``[lo, hi)`` of the flat buffer."""
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def own_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``flat`` (a view)."""
        lo, hi = self.shard_bounds()
        return flat[lo:hi]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of ``flat``, viewed in the parameter's shape."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def shard_slots(self) -> list[tuple[Slot, int, int, int]]:
        """``(slot, start, end, shard_offset)``: elements ``[start, end)`` of the slot's parameter lie
        at ``shard_offset`` of this rank's shard."""
        return [(s, a, b, off) for _, s, a, b, off in self.shard_params()]

    def shard_params(self) -> list[tuple[nn.Parameter, Slot, int, int, int]]:
        """:meth:`shard_slots` with each slot's parameter first: ``(param, slot, start, end, offset)``."""
        lo, hi = self.shard_bounds()
        out = []
        for p, s in zip(self.params, self.slots, strict=True):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((p, s, a - s.offset, b - s.offset, a - lo))
        return out

    def new_flat(self, zero: bool = True) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(self.padded, dtype=self.dtype, device=self.device)

    def copy_params_into(self, flat: torch.Tensor) -> None:
        """Write the parameters' current values into ``flat`` (padding left as it is)."""
        torch._foreach_copy_(self.views(flat), [p.detach() for p in self.params])

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into ``flat``."""
        for view, p in zip(self.views(flat), self.params, strict=True):
            p.data = view
        self.ptrs = [p.data_ptr() for p in self.params]

    def unbind(self) -> None:
        """Drop the parameters' storage: each becomes an empty tensor until the next ``bind`` (an
        operation reading one fails on its shape)."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        self.ptrs = [p.data_ptr() for p in self.params]

    def park(self) -> None:
        """Drop the parameters' storage but keep their logical shape: each becomes a stand-in of its
        shape, dtype and device over its own element of :attr:`marker` (NaN for floating dtypes), so
        ``numel()``, ``dim()`` and ``shape`` are the module's while no memory is held. An operation
        writing several elements into one fails; a fill (``fill_``, ``zero_``) lands in the marker,
        where :class:`~dtlab.models.dp._writes.ParamWrites` finds it."""
        fill = float("nan") if self.dtype.is_floating_point else 0
        self.marker = torch.full((len(self.params),), fill, dtype=self.dtype, device=self.device)
        for one, s, p in zip(self.marker.unbind(), self.slots, self.params, strict=True):
            p.data = one.expand(s.shape)
        self.ptrs = [p.data_ptr() for p in self.params]

    def grads_into(self, flat: torch.Tensor) -> None:
        """Copy (``None`` -> zeros) every parameter's ``.grad`` into ``flat``; padding zeroed. Values
        only: under ``backward(create_graph=True)`` the gradients carry a graph the reduction drops."""
        with torch.no_grad():
            for view, p in zip(self.views(flat), self.params, strict=True):
                if p.grad is None:
                    view.zero_()
                else:
                    copy_grad(view, p.grad)
            flat[self.numel :].zero_()
