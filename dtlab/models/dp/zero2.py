"""ZeRO-2: parameters replicated; gradients reduce-scattered so each rank keeps only its shard.

During a synchronized backward each gradient is copied into its DDP bucket's transient buffer and
released at once; a full bucket is reduce-scattered into this rank's persistent gradient shard and
its buffer dropped. Inside ``no_sync()`` gradients accumulate whole in ``param.grad``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.models.dp.data_parallel import tensor_bytes
from dtlab.models.dp.ddp import DDPModel, DDPOptions
from dtlab.models.dp.flat import FlatUnit

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ZeRO2Model"]


class ZeRO2Model(DDPModel):
    """Reduce-scattered gradients, replicated parameters; same options as DDPModel."""

    strategy_name: ClassVar[str] = "zero2"
    keeps_whole_grads: ClassVar[bool] = False

    def __init__(
        self, module: nn.Module, backend: CommunicationBackend, **options: Unpack[DDPOptions]
    ) -> None:
        super().__init__(module, backend, **options)
        self._grad_shards = [torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device) for u in self._units]
        #: each bucket's whole gradient during a synchronized backward, until its reduce-scatter completes
        self._transient: list[torch.Tensor | None] = [None] * len(self._units)

    def _store_grad(self, i: int, param: nn.Parameter) -> None:
        if not self._sync:
            return  # accumulate in param.grad until the synchronized backward
        buf = self._transient[i]
        if buf is None:
            buf = self._transient[i] = self._units[i].new_flat()
        s = self._units[i].slots[self._slot_of[id(param)][1]]
        if param.grad is not None:
            buf[s.offset : s.offset + s.numel].copy_(param.grad.reshape(-1))
            param.grad = None

    def _launch(self, i: int) -> tuple[Work, Any]:
        buf = self._transient[i]
        if buf is None:
            buf = self._transient[i] = self._units[i].new_flat()
        out = torch.empty_like(self._grad_shards[i])
        return self._reducer.reduce_scatter(self._units[i].key, buf, out), out

    def _complete(self, i: int, extra: Any) -> None:
        self._grad_shards[i].add_(extra)
        self._transient[i] = None

    def _after_sync(self) -> None:
        self._guard_grads()

    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        return self._grad_shards[self._units.index(unit)]

    def zero_grad_buffers(self) -> None:
        self._guarded = False
        for g in self._grad_shards:
            g.zero_()
        for _, q in self._trainable:
            q.grad = None
        self._grads_synced = False

    def scale_grads_(self, factor: float) -> None:
        for g in self._grad_shards:
            g.mul_(factor)

    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        return list(self._grad_shards), False

    def _grad_bytes(self) -> int:
        held = sum(tensor_bytes(g) for g in self._grad_shards)
        held += sum(tensor_bytes(b) for b in self._transient)
        return held + sum(tensor_bytes(q.grad) for _, q in self._trainable)
