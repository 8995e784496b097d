"""Error feedback, one mechanism for every compressor: what a rank did not send it sends later.

Per buffer key a float32 residual is kept. Before an exchange the residual is added to the new
gradient (``acc = grad + residual``); afterwards the residual becomes ``acc - contributed``, where
``contributed`` is exactly what this rank put into the synchronized sum. Summed over ranks,
``P * result + new residuals == gradients + old residuals``: nothing is lost or counted twice.
Non-finite gradients never reach a residual: the reducer checks ``acc`` before anything is sent and
leaves the residual as it was.

Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018), optional: with
``momentum=m`` a float32 velocity ``u`` per key is kept as well and the gradient is accumulated
through it, ``u = m * u + grad``, ``acc = residual + u``, so the momentum of what was not sent keeps
building up locally instead of being applied late by the optimizer. Momentum factor masking: where a
rank sent its value (``sent`` indices), ``u`` is zeroed too. A dense exchange (warm-up, everything
sent) and the dense-shaped compressors (``contributed``) leave ``u`` unmasked: that is plain momentum
SGD, as DGC does for the tensors it does not compress.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtlab.compression.base import Prefilter
from dtlab.compression.kernels import add_count_nonfinite, add_select, add_std_mean, gather_add_abs
from dtlab.errors import ConfigError

__all__ = ["ErrorFeedback"]


def _fit(spare: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``spare`` when it is a float32 buffer of ``like``'s size and device, else a new one."""
    if spare is None or spare.numel() != like.numel() or spare.device != like.device:
        return torch.empty(like.numel(), dtype=torch.float32, device=like.device)
    return spare


def _sampler(src: torch.Tensor, res: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``|src + res|`` at given positions (the float32 sums the accumulating pass writes there)."""

    def sample(pos: torch.Tensor) -> torch.Tensor:
        return gather_add_abs(src, res, pos.to(src.device))

    return sample


class ErrorFeedback:
    """Residuals of one rank, keyed by gradient buffer.

    Two float32 buffers per key, swapped every step: ``accumulate`` writes ``grad + residual`` into
    the spare one, ``update`` turns that buffer into the new residual in place (zeroing what was sent)
    and keeps the old residual as the next spare. No buffer-sized allocation after the first step.
    With ``momentum`` (momentum correction) the velocities are kept the same way: ``accumulate``
    writes ``m * u + grad`` into a spare, ``update`` (or ``discard(keep_velocity=True)``) commits it.
    """

    def __init__(self, momentum: float | None = None) -> None:
        if momentum is not None and (
            isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 < momentum < 1
        ):
            raise ConfigError(
                f"momentum correction must be a float in (0, 1) such as 0.9 (or None), got {momentum!r}"
            )
        self.momentum = None if momentum is None else float(momentum)
        self._residuals: dict[str, torch.Tensor] = {}
        self._spares: dict[str, torch.Tensor] = {}
        self._velocities: dict[str, torch.Tensor] = {}
        self._velocity_spares: dict[str, torch.Tensor] = {}
        self._dense_steps: set[str] = set()  # keys whose last velocity step was a dense one

    def accumulate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` in a float32 buffer owned by this object (valid until ``update``)."""
        return self.accumulate_counted(key, grad)[0]

    def accumulate_counted(
        self, key: str, grad: torch.Tensor, prefilter: Prefilter | None = None
    ) -> tuple[torch.Tensor, int | None]:
        """:meth:`accumulate`, and the number of NaN/Inf values of the result where the same pass
        counted them (``None``: not counted; the caller checks). ``prefilter``: a compressor's
        request; its ``indices`` get the sorted positions with ``|acc| >= threshold``, selected in the
        same pass (left ``None`` on the first step, which only copies the gradient). A sampled
        threshold reads ``|grad + residual|`` at its positions first (bitwise ``|acc|`` there). With
        ``prefilter.zero_source`` the same pass zeroes ``grad`` (``prefilter.source_zeroed`` says
        whether it did; not when the velocity of momentum correction is accumulated instead). A fused
        request (:meth:`~dtlab.compression.base.Prefilter.request_fused`) makes the whole pass."""
        flat = grad.detach().reshape(-1)
        res = self._residuals.get(key)
        if res is not None and res.numel() != flat.numel():
            raise ValueError(
                f"error feedback: buffer {key!r} changed size from {res.numel()} to {flat.numel()} "
                "elements; keys must name the same buffer every step"
            )
        spare = _fit(self._spares.pop(key, None), flat)
        m = self.momentum
        src = flat if m is None else self._next_velocity(key, flat, m)
        bad: int | None = None
        if res is None:
            spare.copy_(src)
        elif (
            prefilter is not None
            and prefilter.fused is not None
            and ((fused_bad := prefilter.fused(src, res, spare)) is not None)
        ):
            bad, prefilter.fused_done = fused_bad, True
        elif prefilter is not None and prefilter.wants_moments:
            bad, prefilter.moments = add_std_mean(src, res, spare)
        elif prefilter is not None and (thr := prefilter.resolve(_sampler(src, res))) > 0:
            zero = prefilter.zero_source and src is flat  # the gradient itself (no velocity)
            bad, prefilter.indices = add_select(src, res, spare, thr, prefilter.expected, zero)
            prefilter.source_zeroed = zero
        else:
            bad = add_count_nonfinite(src, res, spare)
        self._spares[key] = spare
        return spare, bad

    def _next_velocity(self, key: str, flat: torch.Tensor, m: float) -> torch.Tensor:
        """``m * u + grad`` in a spare velocity buffer (committed by ``update``/``discard``)."""
        u = self._velocities.get(key)
        if u is not None and u.numel() != flat.numel():
            raise ValueError(
                f"momentum correction: buffer {key!r} changed size from {u.numel()} to {flat.numel()} "
                "elements; keys must name the same buffer every step"
            )
        spare = _fit(self._velocity_spares.pop(key, None), flat)
        if u is None:
            spare.copy_(flat)
        else:
            torch.add(flat, u, alpha=m, out=spare)
        self._velocity_spares[key] = spare
        return spare

    def _commit_velocity(self, key: str, sent: torch.Tensor | None) -> None:
        if self.momentum is None:
            return
        new = self._velocity_spares.pop(key)
        if sent is not None:
            new[sent] = 0.0  # momentum factor masking
        old = self._velocities.pop(key, None)
        self._velocities[key] = new
        if old is not None:
            self._velocity_spares[key] = old

    def momentum_step(self, key: str, grad: torch.Tensor) -> None:
        """Dense path (no compression, no residual): ``u = m * u + grad``, written into ``grad``
        (plain momentum SGD). A non-finite result leaves ``u`` unchanged (``grad`` gets it, so the
        reducer's non-finite handling sees it). No-op without momentum correction."""
        m = self.momentum
        if m is None:
            return
        flat = grad.detach().reshape(-1)
        new = self._next_velocity(key, flat, m)
        flat.copy_(new)
        if bool(torch.isfinite(new.sum())):
            self._commit_velocity(key, None)
            self._dense_steps.add(key)

    def keep_velocity(self, key: str, offset: int, numel: int) -> None:
        """Put back elements ``[offset, offset + numel)`` of ``key``'s velocity as they were before its
        last step, when that was a dense one (a parameter the optimizer step then skipped: torch leaves
        its momentum buffer alone). The previous velocity is the spare buffer until the next step."""
        u = self._velocities.get(key)
        if key not in self._dense_steps or u is None:
            return
        old = self._velocity_spares.get(key)
        part = u[offset : offset + numel]
        if old is None:  # the first step: no velocity before it
            part.zero_()
        else:
            part.copy_(old[offset : offset + numel])

    def update(
        self,
        key: str,
        acc: torch.Tensor,
        contributed: torch.Tensor | None,
        sent: torch.Tensor | None = None,
        in_place: bool = False,
    ) -> None:
        """New residual ``acc - contributed``: ``sent`` indices contributed in full, or a dense
        ``contributed``; with neither everything was sent and the residual is zero; ``in_place``:
        ``acc`` already holds the residual (the compressor subtracted what it contributed). ``acc``
        must be the buffer :meth:`accumulate` returned; it becomes the residual."""
        if self._spares.get(key) is not acc:
            raise ValueError(f"error feedback: update({key!r}) needs the buffer accumulate() returned")
        del self._spares[key]
        self._dense_steps.discard(key)
        old = self._residuals.pop(key, None)
        if in_place:  # acc already holds acc - contributed
            pass
        elif sent is not None:
            acc.index_fill_(0, sent, 0.0)
        elif contributed is not None:
            acc.sub_(contributed)
        else:
            acc.zero_()
        self._residuals[key] = acc
        if old is not None:
            self._spares[key] = old
        self._commit_velocity(key, sent)

    def discard(self, key: str, acc: torch.Tensor, keep_velocity: bool = False) -> None:
        """Drop ``acc`` without touching the residual (non-finite input, or no error feedback).
        ``keep_velocity``: commit the new velocity unmasked (a compressor without error feedback)."""
        if self._spares.get(key) is not acc:
            raise ValueError(f"error feedback: discard({key!r}) needs the buffer accumulate() returned")
        if self.momentum is not None:
            if keep_velocity:
                self._commit_velocity(key, None)
            else:
                self._velocity_spares.pop(key, None)

    def restore(self, key: str, residual: torch.Tensor | None, velocity: torch.Tensor | None) -> None:
        """Make ``residual`` and ``velocity`` ``key``'s again (None: none), the tensors it held before
        its last change (kept as spares since) or copies: the step that changed them was not applied."""
        for held, spares, old in (
            (self._residuals, self._spares, residual),
            (self._velocities, self._velocity_spares, velocity),
        ):
            now = held.pop(key, None)
            if old is not None:
                held[key] = old
            if now is not None and now is not old:
                spares[key] = now  # scratch for the next step (in place of ``old`` if it was there)
            elif old is not None and spares.get(key) is old:
                del spares[key]
        self._dense_steps.discard(key)

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def keys(self) -> list[str]:
        return sorted(self._residuals)

    def velocity(self, key: str) -> torch.Tensor | None:
        return self._velocities.get(key)

    def velocities(self) -> dict[str, torch.Tensor]:
        """Momentum-correction velocities (copies); empty without momentum correction."""
        return {k: v.clone() for k, v in self._velocities.items()}

    def load_state(
        self, residuals: dict[str, torch.Tensor], velocities: dict[str, torch.Tensor] | None = None
    ) -> None:
        self._residuals = {k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in residuals.items()}
        self._spares.clear()
        self._velocity_spares.clear()
        self._dense_steps.clear()
        self._velocities = {}
        if self.momentum is not None:
            self._velocities = {
                k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in (velocities or {}).items()
            }

    def forget(self, key: str) -> None:
        """Drop ``key``'s residual, velocity and spare buffers (the buffer starts afresh)."""
        for d in (self._residuals, self._spares, self._velocities, self._velocity_spares):
            d.pop(key, None)
        self._dense_steps.discard(key)

    def clear(self) -> None:
        for d in (self._residuals, self._spares, self._velocities, self._velocity_spares):
            d.clear()
        self._dense_steps.clear()

    def nbytes(self) -> int:
        """Bytes held: residuals, velocities and spare buffers."""
        bufs = [
            *self._residuals.values(),
            *self._spares.values(),
            *self._velocities.values(),
            *self._velocity_spares.values(),
        ]
        return sum(t.nbytes for t in bufs)
