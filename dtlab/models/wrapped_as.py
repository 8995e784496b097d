"""What every model strategy checks at each forward (:class:`WrappedAs`): that its module's parameters
kept the dtype and device it wrapped them in, and that Hugging Face's own activation checkpointing
would not recompute other dropout masks than its forward's on in-memory ranks."""

from __future__ import annotations

import torch
from torch import nn

from dtlab.errors import StrategyError
from dtlab.models.hf_checkpointing import unreplayed_draws

__all__ = ["WrappedAs", "conversion_refused"]


def conversion_refused(who: str, name: str, was: torch.Tensor, now: torch.Tensor, how: str) -> StrategyError:
    """The error for a change of parameter ``name``'s dtype or device (from ``was``'s to ``now``'s)
    after the wrapper ``who`` laid out its buffers and shards; ``how``: where the change was found."""
    target = str(now.dtype) if now.dtype != was.dtype else repr(str(now.device))
    return StrategyError(
        f"{who}: {how} parameter {name!r} from {was.dtype} on {was.device} to {now.dtype} on {now.device} "
        "after wrapping (model.double(), .half(), .to(dtype or device), on the wrapper or on "
        "model.module). The strategy lays out its gradient buffers and shards in the parameters' dtype "
        "and device when it wraps the module, so training on would fail or be silently wrong. Convert "
        f"the plain module before wrapping it, e.g. {who}(module.to({target}), backend); for mixed "
        "precision keep float32 parameters and compute under torch.autocast (or the Trainer's "
        "MixedPrecisionPolicy; reduce_dtype= narrows the gradient reduction), docs/strategies.md"
    )


class WrappedAs:
    """Each parameter of ``module`` with an empty tensor of its dtype and device when the wrapper ``who``
    laid out its buffers and shards: :meth:`check` refuses a later ``model.module.double()`` / ``.to()``
    (the wrapper's own conversions are refused before any change, by :meth:`ModelStrategy._apply`).
    ``with wrapped_as:`` checks once for the block and skips the checks inside it (a composition's
    forward or pipelined step, around its data-parallel strategy's forward of each stage). It also
    refuses a training forward on in-memory ranks of Hugging Face layers checkpointed by Hugging Face
    with dropout and without replayed draws (:mod:`dtlab.models.hf_checkpointing`)."""

    def __init__(self, who: str, module: nn.Module) -> None:
        self.who = who
        self._params = [(n, p, p.new_empty(0)) for n, p in module.named_parameters()]
        self._tensors = [p for _, p, _ in self._params]
        self._key = self._now()
        self._held = 0
        self._draws = unreplayed_draws(module)

    def __enter__(self) -> None:
        self.check()
        self._held += 1

    def __exit__(self, *_: object) -> None:
        self._held -= 1

    def _now(self) -> tuple[list[torch.dtype], list[int], list[bool]]:
        """Every parameter's dtype, device index (-1: CPU) and whether on meta: read without building a
        ``torch.device`` per parameter (each ``.device`` read costs about 0.2 us; this runs per forward)."""
        ps = self._tensors
        return [p.dtype for p in ps], list(map(torch.Tensor.get_device, ps)), [p.is_meta for p in ps]

    def check(self) -> None:
        if self._held:
            return
        if self._draws is not None:  # Hugging Face's checkpointing of layers with dropout, in-memory ranks
            self._draws.check(self.who)
        if self._now() == self._key:
            return
        for name, p, was in self._params:
            if p.dtype != was.dtype or p.device != was.device:
                raise conversion_refused(self.who, name, was, p, "model.module converted")
