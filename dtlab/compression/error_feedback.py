"""Error feedback, one mechanism for every compressor: what a rank did not send it sends later.

Per buffer key a float32 residual is kept. Before an exchange the residual is added to the new
gradient (``acc = grad + residual``); afterwards the residual becomes ``acc - contributed``, where
``contributed`` is exactly what this rank put into the synchronized sum. Summed over ranks,
``P * result + new residuals == gradients + old residuals``: nothing is lost or counted twice.
Non-finite gradients never reach a residual: the reducer checks ``acc`` before anything is sent and
leaves the residual as it was.
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residuals of one rank, keyed by gradient buffer.

    Two float32 buffers per key, swapped every step: ``accumulate`` writes ``grad + residual`` into
    the spare one, ``update`` turns that buffer into the new residual in place (zeroing what was sent)
    and keeps the old residual as the next spare. No buffer-sized allocation after the first step.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._spares: dict[str, torch.Tensor] = {}

    def accumulate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` in a float32 buffer owned by this object (valid until ``update``)."""
        flat = grad.detach().reshape(-1)
        res = self._residuals.get(key)
        spare = self._spares.pop(key, None)
        if res is not None and res.numel() != flat.numel():
            raise ValueError(
                f"error feedback: buffer {key!r} changed size from {res.numel()} to {flat.numel()} "
                "elements; keys must name the same buffer every step"
            )
        if spare is None or spare.numel() != flat.numel() or spare.device != flat.device:
            spare = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        if res is None:
            spare.copy_(flat)
        else:
            torch.add(flat, res, out=spare)
        self._spares[key] = spare
        return spare

    def update(
        self, key: str, acc: torch.Tensor, contributed: torch.Tensor | None, sent: torch.Tensor | None = None
    ) -> None:
        """New residual ``acc - contributed``: ``sent`` indices contributed in full, or a dense
        ``contributed``; with neither everything was sent and the residual is zero. ``acc`` must be
        the buffer :meth:`accumulate` returned; it becomes the residual."""
        if self._spares.get(key) is not acc:
            raise ValueError(f"error feedback: update({key!r}) needs the buffer accumulate() returned")
        del self._spares[key]
        old = self._residuals.pop(key, None)
        if sent is not None:
            acc[sent] = 0.0
        elif contributed is not None:
            acc.sub_(contributed)
        else:
            acc.zero_()
        self._residuals[key] = acc
        if old is not None:
            self._spares[key] = old

    def discard(self, key: str, acc: torch.Tensor) -> None:
        """Drop ``acc`` without touching the residual (non-finite input, or no error feedback)."""
        if self._spares.get(key) is not acc:
            raise ValueError(f"error feedback: discard({key!r}) needs the buffer accumulate() returned")

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def keys(self) -> list[str]:
        return sorted(self._residuals)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state(self, residuals: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in residuals.items()}
        self._spares.clear()

    def forget(self, key: str) -> None:
        """Drop ``key``'s residual and spare buffer (the buffer starts afresh)."""
        self._residuals.pop(key, None)
        self._spares.pop(key, None)

    def clear(self) -> None:
        self._residuals.clear()
        self._spares.clear()

    def nbytes(self) -> int:
        """Bytes held: residuals and spare buffers."""
        bufs = [*self._residuals.values(), *self._spares.values()]
        return sum(t.numel() * t.element_size() for t in bufs)
