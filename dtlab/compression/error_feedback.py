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
    """Residuals of one rank, keyed by gradient buffer."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def accumulate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` as a fresh flat float32 tensor (``grad`` itself is not modified)."""
        acc = grad.detach().reshape(-1).to(torch.float32, copy=True)
        res = self._residuals.get(key)
        if res is not None:
            if res.numel() != acc.numel():
                raise ValueError(
                    f"error feedback: buffer {key!r} changed size from {res.numel()} to {acc.numel()} "
                    "elements; keys must name the same buffer every step"
                )
            acc.add_(res)
        return acc

    def update(self, key: str, acc: torch.Tensor, contributed: torch.Tensor | None) -> None:
        """Keep ``acc - contributed`` (``None``: everything was sent, the residual is zero)."""
        if contributed is None:
            self._residuals.pop(key, None)
            return
        self._residuals[key] = acc - contributed

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def keys(self) -> list[str]:
        return sorted(self._residuals)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state(self, residuals: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: v.detach().to(torch.float32).clone() for k, v in residuals.items()}

    def clear(self) -> None:
        self._residuals.clear()
