"""ZeRO-2: parameters replicated; gradients reduce-scattered so each rank keeps only its shard.

During a synchronized backward each gradient is copied into its DDP bucket's transient buffer and
released at once; a full bucket is reduce-scattered into this rank's persistent gradient shard and
its buffer dropped when that completes, which the next bucket's launch waits for: with gradients
arriving bucket after bucket, two buffers are alive at most (one filling, one in flight), not the
whole gradient. A buffer is taken uninitialized, not zeroed (no memset of the whole bucket each
step): each parameter's slot is written once (zeros for one without gradient), the padding zeroed.
Inside ``no_sync()`` gradients accumulate whole in ``param.grad``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.models.dp._grad_guard import tensor_bytes
from dtlab.models.dp.ddp import DDPModel, DDPOptions
from dtlab.models.dp.flat import copy_grad

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ZeRO2Model"]


class ZeRO2Model(DDPModel):
    """Reduce-scattered gradients, replicated parameters; same options as DDPModel."""

    strategy_name: ClassVar[str] = "zero2"
    keeps_whole_grads: ClassVar[bool] = False
    max_in_flight: ClassVar[int] = 1

    def __init__(
        self, module: nn.Module, backend: CommunicationBackend, **options: Unpack[DDPOptions]
    ) -> None:
        super().__init__(module, backend, **options)
        self._synced_grads = [torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device) for u in self._units]
        #: bucket index -> its whole gradient during a synchronized backward, until its reduce-scatter
        #: completes (every bucket launched has one: its parameters' gradients were copied in first)
        self._transient: dict[int, torch.Tensor] = {}

    def _store_grad(self, i: int, param: nn.Parameter) -> None:
        if not self._sync:
            return  # accumulate in param.grad until the synchronized backward
        unit = self._units[i]
        if i not in self._transient:  # uninitialized: each slot is written below, the padding here
            self._transient[i] = unit.new_flat(zero=False)
            self._transient[i][unit.numel :].zero_()
        s = unit.slots[self._slot_of[id(param)][1]]
        view = self._transient[i][s.offset : s.offset + s.numel].view(s.shape)
        if param.grad is None:  # no gradient (find_unused_parameters): its part of the average is zeros
            view.zero_()
        else:
            copy_grad(view, param.grad)
            param.grad = None

    def _end_step(self) -> None:
        super()._end_step()
        self._transient.clear()  # also after an error: no half-filled bucket is reused by a later reduction

    def _launch(self, i: int) -> tuple[Work, Any]:
        out = torch.empty_like(self._synced_grads[i])
        return self._reducer.reduce_scatter(self._units[i].key, self._transient[i], out), out

    def _complete(self, i: int, extra: Any) -> None:
        self._synced_grads[i].add_(extra)
        del self._transient[i]

    def _after_synchronized(self) -> None:
        self._guard_grads()
        super()._after_synchronized()

    def _grad_bytes(self) -> int:
        held = sum(tensor_bytes(b) for b in self._transient.values())
        return super()._grad_bytes() + held + sum(tensor_bytes(q.grad) for _, q in self._trainable)
