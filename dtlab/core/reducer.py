"""The gradient reducer: how a model strategy's gradients travel across its data-parallel group.

Every model strategy owns one reducer and sends all gradients through it, with all-reduce semantics
(DDP, ZeRO-1, the data-parallel group of pipeline/tensor/hybrid) or reduce-scatter semantics
(ZeRO-2/3, FSDP). Both return the *average* over ranks (sum / P), like torch DDP. The reducer is
swappable (``model.gradient_reducer = ...``): gradient compression plugs in a compressed reducer
without touching the strategies.

``key`` names a gradient buffer stably across steps (a bucket index, a parameter or unit name), so a
stateful reducer (error feedback, Ok-Topk thresholds) can keep per-buffer state.

This module lives in the neutral layer :mod:`dtlab.core` (below both models and compression) so the
model strategies and the compressed reducer both import it downwards; see docs/architecture.md,
section "The reducer seam".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work, check_backend

__all__ = ["DenseReducer", "GradientReducer", "check_reduce_dtype"]


def check_reduce_dtype(reduce_dtype: object) -> None:
    """Refuses a ``reduce_dtype`` gradients cannot travel in (a string such as ``"bf16"``, an int dtype)."""
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise ValueError(
            f"reduce_dtype must be a floating-point torch.dtype (e.g. torch.float32) or None, got "
            f"{reduce_dtype!r}"
        )


class GradientReducer(ABC):
    """Averages gradient buffers over a data-parallel group (``backend``)."""

    def __init__(self, backend: CommunicationBackend) -> None:
        check_backend(backend, type(self).__name__)
        self.backend = backend

    @abstractmethod
    def all_reduce(self, key: str, grad: torch.Tensor) -> Work:
        """Replace the flat, contiguous ``grad`` by its average over ranks (complete after ``wait()``)."""

    @abstractmethod
    def reduce_scatter(self, key: str, grad: torch.Tensor, shard: torch.Tensor) -> Work:
        """``grad`` is flat with ``P * shard.numel()`` elements; ``shard`` receives the average of
        chunk ``rank`` (complete after ``wait()``). ``grad``'s content afterwards is unspecified."""

    def step_statistics(self) -> dict[str, Any]:
        """Statistics of the last step (compressed reducers report density, bytes, ratio, times)."""
        return {}

    def start_step(self) -> None:  # noqa: B027 - optional hook
        """Called by the strategy before the first gradient of a step is reduced."""

    def discard_step(self) -> None:  # noqa: B027 - optional hook
        """Called by the strategy when the synchronized backward that called :meth:`start_step` raised
        partway (its gradients are dropped): a reducer keeping state across steps undoes what that
        backward's calls changed, or refuses its later calls, naming the fix."""


class DenseReducer(GradientReducer):
    """Uncompressed reduction; ``reduce_dtype`` (e.g. ``torch.float32`` for bf16 parameters) sets the
    dtype gradients travel and are summed in; results are cast back to the gradient's dtype. float16 is
    divided by the group size before the sum (as torch DDP divides, and the FP16 compressor), so the
    sum cannot overflow where the average does not. Over a group of one rank nothing is sent (the
    average is the gradient itself)."""

    def __init__(self, backend: CommunicationBackend, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(backend)
        check_reduce_dtype(reduce_dtype)
        self.reduce_dtype = reduce_dtype

    def _wire(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``t`` in the dtype it is summed in (``t`` itself when that is its dtype), and what the sum is
        still to be divided by: float16 is divided first, in ``t``'s dtype, before the cast."""
        dtype, p = self.reduce_dtype or t.dtype, self.backend.world_size
        if dtype != torch.float16:
            return (t if dtype == t.dtype else t.to(dtype)), p
        if t.dtype == dtype:
            return t.div_(p), 1
        return torch.div(t, p, out=torch.empty_like(t, dtype=dtype)), 1

    def all_reduce(self, key: str, grad: torch.Tensor) -> Work:  # noqa: ARG002 - the GradientReducer interface; a dense reduction keeps no per-buffer state
        if self.backend.world_size == 1:  # one replica: the average is the gradient itself
            return CompletedWork()
        buf, left = self._wire(grad)
        work = self.backend.iall_reduce(buf, ReduceOp.SUM)
        return _Finish(work, lambda: _average_into(grad, buf, left))

    def reduce_scatter(self, key: str, grad: torch.Tensor, shard: torch.Tensor) -> Work:  # noqa: ARG002 - the GradientReducer interface; a dense reduction keeps no per-buffer state
        if self.backend.world_size == 1:
            shard.copy_(grad.reshape(shard.shape))
            return CompletedWork()
        buf, left = self._wire(grad)
        out = shard if buf.dtype == shard.dtype else torch.empty_like(shard, dtype=buf.dtype)
        work = self.backend.ireduce_scatter(out, buf, ReduceOp.SUM)
        return _Finish(work, lambda: _average_into(shard, out, left))


def _average_into(dst: torch.Tensor, summed: torch.Tensor, divisor: int) -> None:
    if divisor != 1:
        summed.div_(divisor)
    if summed is not dst:
        dst.copy_(summed)


class _Finish(Work):
    """Waits for the engine's handle, then runs the finishing step (average, cast back) once."""

    def __init__(self, work: Work, finish: Any) -> None:
        self._work, self._finish, self._done = work, finish, False

    def wait(self) -> int | None:
        if not self._done:
            self._work.wait()
            self._finish()
            self._done = True
        return None

    def is_completed(self) -> bool:
        return self._done
