"""ZeRO-1: parameters and gradient buffers replicated (as DDP), optimizer state sharded.

The model keeps DDP's persistent, full-size gradient buckets (``param.grad`` are views into them, so
accumulation inside ``no_sync()`` costs nothing extra) and its bucketed, overlapped launch during
backward. :class:`~dtlab.optimizers.ZeRO1Optimizer` steps only this rank's ``1/P`` of every bucket and
all-gathers the updated parameters, so this rank only *needs* the average of its own ``1/P`` of the
gradient. How the buckets are synchronized is the ``gradient_sync`` option:

- ``"reduce_scatter"`` (default, DeepSpeed's ZeRO-1 traffic): each bucket is reduce-scattered;
  this rank's slice of the bucket receives the average, the rest of the bucket is zeroed. Per step:
  reduce-scatter + all-gather of the parameters = ``2(P-1)/P`` of the gradient bytes, as DDP.
  The bucket then holds the averaged gradient on this rank's shard only (zeros elsewhere), so
  ``param.grad`` refuses to be read as a whole gradient until the next forward (see
  :mod:`dtlab.models.dp._grad_guard`); clipping and the finite check work on the shards (a sum over
  ranks).
- ``"all_reduce"``: DDP's all-reduce, so every rank holds the whole averaged gradient (for gradient
  hooks or inspection of ``param.grad``, or a reducer that only offers all-reduce semantics), at
  ``3(P-1)/P`` of the gradient bytes per step.

Gradients left in place across synchronized backward passes (no ``zero_grad()`` between them) add up
as in DDP in both modes: with ``"reduce_scatter"`` the next forward scales this rank's averaged slice
by ``P`` (its term of the next sum; the other ranks hold zeros there) and the next reduction averages
``old + new``; a backward not preceded by this model's forward is an error then, not a wrong sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.errors import StrategyError
from dtlab.models.base import AttachedOptimizer
from dtlab.models.dp.ddp import DDPModel, DDPOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GradientSync", "ZeRO1Model", "gradient_sync_for"]

GradientSync = Literal["reduce_scatter", "all_reduce"]


def gradient_sync_for(model: str, chosen: GradientSync | None, optimizer: AttachedOptimizer) -> GradientSync:
    """How a model strategy with a ZeRO-1 dp axis (tensor, pipeline) reduces its gradients under
    ``optimizer``: ``chosen`` when the user set it, else reduce-scatter for ``ZeRO1Optimizer`` and
    all-reduce for the others. A reduce-scatter chosen for an optimizer that steps whole gradients is
    refused, naming both."""
    wants: GradientSync = "reduce_scatter" if optimizer.strategy_name == "zero1" else "all_reduce"
    if chosen is None:
        return wants
    if chosen == "reduce_scatter" and wants != "reduce_scatter":
        raise StrategyError(
            f"{model}(gradient_sync='reduce_scatter') leaves each rank only its shard of "
            f"the averaged gradient, which {type(optimizer).__name__} cannot step; use ZeRO1Optimizer "
            "or gradient_sync='all_reduce' (or leave it unset)"
        )
    return chosen


class ZeRO1Model(DDPModel):
    """Whole parameters and gradient buffers for an optimizer whose state is sharded.

    Args:
        module, backend, bucket_cap_mb, reduce_dtype, find_unused_parameters, broadcast_buffers:
            as for DDPModel.
        gradient_sync: ``"reduce_scatter"`` (default: each rank receives the average of its shard,
            ``2(P-1)/P`` per step with the parameter all-gather) or ``"all_reduce"`` (every rank
            receives the whole average, ``3(P-1)/P`` per step).
    """

    strategy_name: ClassVar[str] = "zero1"

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        gradient_sync: GradientSync = "reduce_scatter",
        **options: Unpack[DDPOptions],
    ) -> None:
        if gradient_sync not in ("reduce_scatter", "all_reduce"):
            raise ValueError(
                f"gradient_sync must be 'reduce_scatter' (each rank gets the average of its shard) or "
                f"'all_reduce' (every rank gets the whole average), got {gradient_sync!r}"
            )
        super().__init__(module, backend, **options)
        self.gradient_sync: GradientSync = gradient_sync
        # reduce_scatter mode: "local" (sums of local gradients), "averaged" (this rank's slice holds the
        # average, the rest zeros) or "rescaled" (the average x P, ready to be accumulated into)
        self._grad_state: Literal["local", "averaged", "rescaled"] = "local"

    # ------------------------------------------------------------------ reduce-scatter mode
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._grad_state == "averaged" and torch.is_grad_enabled():
            self._scale_own_slices(float(self.dp_backend.world_size))
            self._grad_state = "rescaled"
        return super().forward(*args, **kwargs)

    def _scale_own_slices(self, factor: float) -> None:
        """Gradients kept across synchronized backwards: this rank's averaged slice x P is its term of
        the next sum (the other ranks hold zeros there), so the next reduction averages ``old + new``
        exactly as an all-reduce would; ``/ P`` undoes it when no backward came after the forward."""
        if factor == 1.0:
            return
        for unit, buf in zip(self._units, self._grad_bufs, strict=True):
            lo, hi = unit.shard_bounds()
            buf[lo:hi].mul_(factor)

    def _settle(self) -> None:
        """A forward ran but no backward: give the optimizer the averaged slice back."""
        if self._grad_state == "rescaled":
            self._scale_own_slices(1.0 / self.dp_backend.world_size)
            self._grad_state = "averaged"

    def _begin_backward(self) -> None:
        if not self._in_backward:
            if self._grad_state == "averaged":
                raise StrategyError(
                    f"ZeRO1Model on rank {self.dp_backend.rank}: a backward pass started while the gradient "
                    "buckets hold the last synchronized (reduce-scattered) gradients and this model's "
                    "forward did not run before it (was the wrapped module called directly?). Call "
                    "opt.zero_grad() after opt.step(), run the forward through the ZeRO1Model, or pass "
                    "gradient_sync='all_reduce'"
                )
            self._grad_state = "local"
        super()._begin_backward()

    def _launch(self, i: int) -> tuple[Work, Any]:
        if self.gradient_sync == "all_reduce":
            return super()._launch(i)
        buf, unit = self._grad_bufs[i], self._units[i]
        out = torch.empty(unit.shard_numel, dtype=buf.dtype, device=buf.device)
        return self._reducer.reduce_scatter(unit.key, buf, out), out

    def _complete(self, i: int, extra: Any) -> None:
        if self.gradient_sync == "all_reduce":
            return
        buf = self._grad_bufs[i]
        lo, hi = self._units[i].shard_bounds()
        buf[:lo].zero_()
        buf[hi:].zero_()
        buf[lo:hi].copy_(extra)
        self._grad_state = "averaged"

    def _after_sync(self) -> None:
        if self.gradient_sync == "reduce_scatter":  # param.grad holds only this rank's slice
            self._guard_grads()

    def reduce_accumulated_grads(self) -> None:
        if self._grad_state == "rescaled":  # kept gradients (x P), summed anew with the new ones
            self._grad_state = "local"
        super().reduce_accumulated_grads()

    def zero_grad_buffers(self) -> None:
        super().zero_grad_buffers()
        self._grad_state = "local"

    def check_grads_ready(self, who: str) -> None:
        super().check_grads_ready(who)
        self._settle()

    def scale_grads_(self, factor: float) -> None:
        self._settle()
        super().scale_grads_(factor)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        self._settle()
        if self.gradient_sync == "all_reduce":
            return super().norm_grad_tensors()
        shards = []
        for unit, buf in zip(self._units, self._grad_bufs, strict=True):
            lo, hi = unit.shard_bounds()
            shards.append(buf[lo:hi])
        return shards, False
