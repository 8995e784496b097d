"""ZeRO-1: DDP's whole, persistent gradient buckets for an optimizer whose state is sharded.

``gradient_sync="reduce_scatter"`` (default) leaves each rank the average of its ``1/P`` of every
bucket (zeros elsewhere, ``param.grad`` refusing use until the next forward), DDP's traffic with the
parameter all-gather; ``"all_reduce"`` gives every rank the whole average (docs/strategies.md, "When
to use which"). Gradients kept across synchronized backwards add up as in DDP: the next forward
scales this rank's averaged slice by ``P`` (its term of the next sum; the others hold zeros there),
so a backward not preceded by this model's forward is an error then, not a wrong sum.
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
    if chosen == "reduce_scatter" and wants != "reduce_scatter":
        raise StrategyError(
            f"{model}(gradient_sync='reduce_scatter') leaves each rank only its shard of "
            f"the averaged gradient, which {type(optimizer).__name__} cannot step; use ZeRO1Optimizer "
            "or gradient_sync='all_reduce' (or leave it unset)"
        )
    return chosen or wants


class ZeRO1Model(DDPModel):
    """Whole parameters and gradient buffers for an optimizer whose state is sharded; DDPModel's
    options, and ``gradient_sync``: ``"reduce_scatter"`` (each rank receives the average of its shard,
    ``2(P-1)/P`` per step with the parameter all-gather) or ``"all_reduce"`` (``3(P-1)/P``)."""

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
        """x P before a backward adding to kept gradients (see the module docstring); / P undoes it
        when no backward came after the forward."""
        for unit, buf in zip(self._units, self._grad_bufs, strict=True):
            unit.own_shard(buf).mul_(factor)

    def _settle(self) -> None:
        """A forward ran but no backward: give the optimizer the averaged slice back."""
        if self._grad_state == "rescaled":
            self._scale_own_slices(1.0 / self.dp_backend.world_size)
            self._grad_state = "averaged"

    def _begin_backward(self) -> None:
        if self._fills_no_grads():  # torch.autograd.grad: nothing to reduce, the buckets untouched
            return super()._begin_backward()  # (DDPModel's watches it: see there)
        if not self._backward.open:
            if self._grad_state == "averaged":
                raise StrategyError(
                    f"ZeRO1Model on rank {self.dp_backend.rank}: a backward pass started while the gradient "
                    "buckets hold the last synchronized (reduce-scattered) gradients and this model's "
                    "forward did not run before it (was the wrapped module called directly, or is it a "
                    "second backward over one forward, after backward(retain_graph=True)?). Call "
                    "opt.zero_grad() after opt.step(), run the forward through the ZeRO1Model, add the "
                    "losses and call backward() once per forward, or pass gradient_sync='all_reduce'"
                )
            self._grad_state = "local"
        super()._begin_backward()

    def _launch(self, i: int) -> tuple[Work, Any]:
        if self.gradient_sync == "all_reduce":
            return super()._launch(i)
        out = self._grad_bufs[i].new_empty(self._units[i].shard_numel)
        return self._reducer.reduce_scatter(self._units[i].key, self._grad_bufs[i], out), out

    def _complete(self, i: int, extra: Any) -> None:
        if self.gradient_sync == "all_reduce":
            return
        buf = self._grad_bufs[i]
        buf.zero_()
        self._units[i].own_shard(buf).copy_(extra)
        self._grad_state = "averaged"

    def _after_synchronized(self) -> None:
        if self.gradient_sync == "reduce_scatter":  # param.grad holds only this rank's slice
            self._guard_grads()
        super()._after_synchronized()

    def reduce_accumulated_grads(self, *, unused_checked: bool = False) -> None:
        if self._grad_state == "rescaled":  # kept gradients (x P), summed anew with the new ones
            self._grad_state = "local"
        super().reduce_accumulated_grads(unused_checked=unused_checked)

    def zero_grad_buffers(self, set_to_none: bool = True) -> None:
        super().zero_grad_buffers(set_to_none)
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
        return [u.own_shard(buf) for u, buf in zip(self._units, self._grad_bufs, strict=True)], False
