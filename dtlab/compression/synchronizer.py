"""``GradientSynchronizer``: compressed gradient averaging for a user's own training loop.

::

    sync = GradientSynchronizer(OkTopk(density=0.01), backend)
    loss.backward()
    grads = sync.sync({n: p.grad for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        p.grad = grads[n]
    opt.step()

All gradients are flattened into one float32 buffer (as the Ok-Topk reference code merges them), so
``k = density * total elements`` and the selection is global over the model. The buffer's layout
(each gradient's offset and shape) goes to the compressor, so PowerSGD approximates every matrix on
its own. Returns averaged gradients (sum / P), shaped and typed like the inputs (dense, a sparse
gradient included). ``statistics`` holds the last call's figures.

The error-feedback residual is kept per element of that buffer, so every call must pass the same
gradients (names, shapes, dtypes) as the first: in another order they are put back in the first
call's order; a missing, added or reshaped gradient is refused once the compressor keeps state (the
residual of a gradient left out would be dropped, or land on another gradient's elements).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, check_backend
from dtlab.compression.base import Compressor
from dtlab.compression.reducer import CompressedReducer, NonFinitePolicy
from dtlab.errors import ArgumentError, CollectiveMismatchError

__all__ = ["GradientSynchronizer"]

KEY = "gradients"
#: one gradient of the flat buffer: name, shape, dtype
Entry = tuple[str, torch.Size, torch.dtype]


class GradientSynchronizer:
    """Average named gradients over ``backend`` through ``compressor`` (error feedback included)."""

    def __init__(
        self,
        compressor: Compressor,
        backend: CommunicationBackend,
        *,
        dense_below: int = 1024,
        nonfinite: NonFinitePolicy = "raise",
    ) -> None:
        check_backend(backend, "GradientSynchronizer")
        self.backend = backend
        self.reducer = CompressedReducer(backend, compressor, dense_below=dense_below, nonfinite=nonfinite)
        self.statistics: dict[str, Any] = {}
        self._layout: list[Entry] | None = None

    @property
    def compressor(self) -> Compressor:
        return self.reducer.compressor

    def _validate(self, named_grads: Mapping[str, torch.Tensor]) -> list[Entry]:
        if not isinstance(named_grads, Mapping) or len(named_grads) == 0:
            raise ValueError(
                "GradientSynchronizer.sync needs a non-empty mapping name -> gradient tensor, got "
                f"{type(named_grads).__name__} {named_grads!r:.60}"
            )
        layout = []
        for name, g in named_grads.items():
            if not isinstance(g, torch.Tensor):
                raise TypeError(
                    f"gradient {name!r} must be a torch.Tensor, got {type(g).__name__} (None: no grad yet?)"
                )
            if not g.is_floating_point():
                raise TypeError(f"gradient {name!r} must be floating point, got {g.dtype}")
            if g.numel() == 0:
                raise ValueError(f"gradient {name!r} is empty (0 elements); leave it out of named_grads")
            layout.append((name, g.shape, g.dtype))
        if self._layout is not None and layout != self._layout:
            kept = self._kept_layout(self._layout, layout)
            if kept is not None:
                return kept
        if layout != self._layout:
            signature = [(n, tuple(s), str(d)) for n, s, d in layout]
            every = self.backend.all_gather_object(signature)
            differing = [r for r, s in enumerate(every) if s != signature]
            if differing:
                raise CollectiveMismatchError(
                    f"GradientSynchronizer.sync: rank {self.backend.rank} passes gradients "
                    f"{signature[:4]}... but rank(s) {differing} pass different names/shapes/dtypes; "
                    "every rank must pass the same gradients in the same order"
                )
            self._layout = layout
            # parameter shapes in the flat buffer: PowerSGD compresses each matrix on its own
            offsets, shapes, offset = [], [], 0
            for _, shape, _ in layout:
                offsets.append(offset)
                shapes.append(tuple(shape))
                offset += shape.numel()
            self.reducer.layouts[KEY] = list(zip(offsets, shapes, strict=True))
        return layout

    def _kept_layout(self, first: list[Entry], layout: list[Entry]) -> list[Entry] | None:
        """``first`` (the first call's layout) for the same gradients in another order; None for another
        set while the reducer keeps no state (a new layout starts afresh); refused while it does."""
        before, now = {n: (s, d) for n, s, d in first}, {n: (s, d) for n, s, d in layout}
        if before == now:
            return first
        if not self.reducer.has_reduced():
            return None
        missing = [n for n in before if n not in now]
        added = [n for n in now if n not in before]
        changed = [n for n in now if n in before and now[n] != before[n]]
        raise ArgumentError(
            f"GradientSynchronizer.sync on rank {self.backend.rank}: the gradients passed differ from the "
            f"first call's (missing {missing[:5]}, added {added[:5]}, another shape or dtype "
            f"{changed[:5]}), while {self.compressor.name}'s error-feedback residual holds what earlier "
            "calls did not send, element by element of the first call's gradients: it would be dropped or "
            "added to other gradients. Pass the same gradients at every call, with zeros for a parameter "
            "that got none (p.grad if p.grad is not None else torch.zeros_like(p)), and apply every "
            "averaged gradient returned; or build a new GradientSynchronizer for the new set (its "
            "residuals start from zero)"
        )

    def sync(self, named_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return ``{name: averaged gradient}`` for every input (new tensors; inputs are not modified)."""
        layout = self._validate(named_grads)
        flat = torch.cat(
            [named_grads[n].detach().to_dense().reshape(-1).to(torch.float32) for n, _, _ in layout]
        )
        self.reducer.start_step()
        self.reducer.all_reduce(KEY, flat).wait()
        self.statistics = self.reducer.step_statistics()
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape, dtype in layout:
            n = shape.numel()
            out[name] = flat[offset : offset + n].view(shape).to(dtype)
            offset += n
        return out
