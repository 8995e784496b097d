"""``CompressedReducer``: a :class:`GradientReducer` that sends gradients through a compressor.

It is what :class:`~dtlab.optimizers.compression.GradientCompressionOptimizer` plugs into a model
strategy and what :class:`~dtlab.compression.GradientSynchronizer` uses on its own. Per call:

1. ``acc = grad + residual`` (error feedback), checked for NaN/Inf on every rank (the ``P`` counts
   exchanged before any payload moves, so every rank decides alike: raise, or with ``nonfinite="skip"``
   return NaN gradients so a NaN guard skips the step; the residual is left untouched either way): one
   all-reduce of ``P`` int32, or inside the compressor's first count exchange
   (:meth:`Compressor.checked_exchange`, Ok-Topk). It decides the dp group's exchange; the step-wide
   decision is the optimizer's ``grads_are_finite()`` (over ``model.world_backend``);
2. dense exchange during the compressor's ``warmup_steps``, else the compressor's exchange;
3. ``residual = acc - contributed``; the average is written back in the gradient's dtype;
4. bytes (from ``backend.stats`` deltas), selection and times are added to this step's statistics.

``Dense`` and buffers below ``dense_below`` elements use the plain dense reducer unchanged (bit-exact,
overlapped where the engine overlaps; ``reduce_dtype`` as the strategy's own dense reducer).
Compressed exchanges complete inside the call (the returned ``Work`` is already complete).
``momentum_correction=m`` (optional): DGC momentum correction and momentum factor masking in the
error feedback (:mod:`dtlab.compression.error_feedback`); the dense path then sends the velocity
``u = m * u + grad`` (plain momentum SGD; the optimizer must have none). ``step_log`` (enabled by
the optimizer) undoes a step that was not applied (:mod:`dtlab.compression.skipped`).
``layouts`` (optional): buffer key -> ``(offset, shape)`` of its parameters, for the compressor's
state (PowerSGD compresses per parameter). ``tp_whole`` (optional, tp > 1): buffer key -> the
``(offset, numel)`` of the parameters every tp rank holds whole, compressed as a buffer of their own
(:mod:`dtlab.compression.tp_parts`) so every tp rank treats their gradient alike.

:meth:`CompressedReducer.state_dict` / :meth:`CompressedReducer.load_state_dict` carry everything that
affects future steps (per buffer: residual, iteration count, the compressor's state, encoded
generically by :mod:`dtlab.compression.state_io`), so a resumed run continues exactly; a restored
buffer of another size (another bucket layout) starts afresh, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

import torch

from dtlab.backends.base import CommunicationBackend, CompletedWork, Work
from dtlab.compression.base import (
    Compressor,
    Exchange,
    Layout,
    NonFiniteGradientError,
    SparseCompressor,
    dense_exchange,
)
from dtlab.compression.dense import Dense
from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.compression.finite import ExchangeSkipped, FiniteCheck
from dtlab.compression.skipped import StepLog
from dtlab.compression.state_io import decode_state, encode_state
from dtlab.compression.stats import StepStatistics
from dtlab.compression.tp_parts import OWN, WHOLE, Ranges, TpParts
from dtlab.core.reducer import DenseReducer, GradientReducer
from dtlab.errors import CheckpointError, ConfigError, DtlabError, StrategyError, integer

__all__ = ["CompressedReducer"]

NonFinitePolicy = Literal["raise", "skip"]

#: tensor name prefixes in :meth:`CompressedReducer.state_dict`
RESIDUAL, STATE, VELOCITY = "residual.", "state.", "velocity."


class CompressedReducer(GradientReducer):
    """Average gradients over ``backend`` through ``compressor`` with error feedback and statistics."""

    def __init__(
        self,
        backend: CommunicationBackend,
        compressor: Compressor,
        *,
        dense_below: int = 1024,
        nonfinite: NonFinitePolicy = "raise",
        reduce_dtype: torch.dtype | None = None,
        layouts: Mapping[str, Layout] | None = None,
        momentum_correction: float | None = None,
        tp_whole: Mapping[str, Ranges] | None = None,
    ) -> None:
        super().__init__(backend)
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"compressor must be a dtlab.compression compressor such as OkTopk(density=0.01), "
                f"got {type(compressor).__name__}"
            )
        if (below := integer(dense_below)) is None or below < 0:
            raise ConfigError(f"dense_below must be an integer >= 0 (elements), got {dense_below!r}")
        if nonfinite not in ("raise", "skip"):
            raise ConfigError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.compressor, self.dense_below, self.nonfinite = compressor, below, nonfinite
        self.error_feedback = ErrorFeedback(momentum_correction)
        self.momentum_correction = self.error_feedback.momentum
        # at density 1.0 momentum factor masking would zero the whole velocity: send dense (as DGC)
        full = isinstance(compressor, SparseCompressor) and compressor.density >= 1
        self._all_dense = isinstance(compressor, Dense) or (full and self.momentum_correction is not None)
        self._dense = DenseReducer(backend, reduce_dtype)
        self._states: dict[str, dict[str, Any]] = {}
        self.layouts: dict[str, Layout] = dict(layouts or {})
        self.tp_parts = TpParts(tp_whole)
        for key, layout in self.layouts.copy().items():
            if key in self.tp_parts.ranges:
                self.layouts[key + WHOLE], self.layouts[key + OWN] = self.tp_parts.layouts(key, layout)
        self._steps: dict[str, int] = {}
        self.step_log = StepLog(self.error_feedback, self._steps, backend.rank)
        self._numels: dict[str, int] = {}  # compressed buffers seen (or restored) and their sizes
        self._restored: dict[str, dict[str, Any]] = {}  # loaded compressor state, applied on first use
        self._touched: list[str] = []  # buffers whose state the calls since start_step() changed
        self._discarded: list[str] = []  # the touched buffers of a backward that raised (see discard_step)
        self._stats = StepStatistics(
            compressor.name, compressor.reduce_scatter_variant, compressor.warmup_steps
        )

    # ------------------------------------------------------------------ GradientReducer
    def all_reduce(self, key: str, grad: torch.Tensor) -> Work:
        self._check(key, grad, None)
        return self._run(key, grad, None)

    def reduce_scatter(self, key: str, grad: torch.Tensor, shard: torch.Tensor) -> Work:
        self._check(key, grad, shard)
        return self._run(key, grad, shard)

    def start_step(self) -> None:
        self._touched = []
        self._stats = StepStatistics(
            self.compressor.name, self.compressor.reduce_scatter_variant, self.compressor.warmup_steps
        )

    def step_statistics(self) -> dict[str, Any]:
        return self._stats.as_dict()

    def discard_step(self) -> None:
        """The backward since :meth:`start_step` raised partway: the buffers it already reduced changed
        their residuals (velocities) and iteration counts, which would carry part of the skipped batch
        into later steps, so later reductions and :meth:`state_dict` (a checkpoint, an elastic commit)
        are refused until :meth:`clear_state` or :meth:`load_state_dict` (nothing changed if it raised
        before any buffer was reduced)."""
        if self._touched:
            self._discarded, self._touched = self._touched, []

    def _refuse_discarded(self, refused: str) -> None:
        if self._discarded:
            raise StrategyError(
                f"compressed reducer on rank {self.backend.rank}: a synchronized backward raised partway "
                f"after buffer(s) {self._discarded[:5]} went through {self.compressor.name}, changing their "
                f"error-feedback residuals and iteration counts, so {refused} is refused: it would carry "
                "part of the skipped batch into later steps. Restore the last checkpoint (it holds this "
                "reducer's state), or call model.gradient_reducer.clear_state() on every rank to restart "
                "error feedback from zero, then opt.zero_grad() and go on"
            )

    def iteration(self, key: str) -> int:
        """How many times buffer ``key`` has been reduced (warm-up included)."""
        return self._steps.get(key, 0)

    def has_reduced(self) -> bool:
        """Whether any buffer was reduced (or restored with a nonzero count) since the last clear."""
        return any(self._steps.values())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's state: tensors (residuals ``residual.<key>``, compressor tensors
        ``state.<key>/<field>``, momentum-correction velocities ``velocity.<key>``) and JSON
        metadata ``{"buffers": {key: {numel, iterations, state}}}``. Refused after a backward that
        raised partway changed some of it (see :meth:`discard_step`)."""
        self._refuse_discarded("saving this state (a checkpoint, an elastic commit)")
        tensors: dict[str, torch.Tensor] = {}
        buffers: dict[str, Any] = {}
        for key in sorted(self._numels):
            res = self.error_feedback.residual(key)
            if res is not None:
                tensors[RESIDUAL + key] = res.detach().to("cpu", copy=True)
            state = self._states.get(key, self._restored.get(key, {}))
            buffers[key] = {
                "numel": self._numels[key],
                "iterations": self._steps.get(key, 0),
                "state": encode_state(state, f"{STATE}{key}/", tensors),
            }
        for key, u in self.error_feedback.velocities().items():
            tensors[VELOCITY + key] = u.to("cpu")
        return tensors, {"buffers": buffers}

    def load_state_dict(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], compressor_state: bool = True
    ) -> None:
        """Restore what :meth:`state_dict` returned (replacing all current state); with
        ``compressor_state=False`` (another compressor configuration) residuals, velocities and iteration
        counts only. Metadata without ``buffers`` (older checkpoints): residuals only."""
        self.clear_state()
        device = self.backend.device
        buffers = metadata.get("buffers", {})
        if not isinstance(buffers, dict):
            raise CheckpointError(f"compression state: 'buffers' must be a JSON object, got {buffers!r}")
        for key, info in buffers.items():
            try:
                numel, iterations, doc = int(info["numel"]), int(info["iterations"]), info["state"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"compression state of buffer {key!r} is malformed ({exc!r}; expected numel, "
                    f"iterations and state, got {info!r}); resume from another checkpoint"
                ) from exc
            self._numels[key], self._steps[key] = numel, iterations
            if compressor_state:
                self._restored[key] = decode_state(doc, tensors, device)
        residuals = {k[len(RESIDUAL) :]: v.to(device) for k, v in tensors.items() if k.startswith(RESIDUAL)}
        for key, res in residuals.items():
            self._numels.setdefault(key, res.numel())
        velocities = {k[len(VELOCITY) :]: v.to(device) for k, v in tensors.items() if k.startswith(VELOCITY)}
        self.error_feedback.load_state(residuals, velocities)
        stale = self.tp_parts.other_layout(self._numels)
        if stale and self.backend.rank == 0:
            logging.getLogger(__name__).warning(
                "compressed reducer: restored state of buffer(s) %s belongs to another tensor-parallel cut "
                "(a bucket compressed whole, or as its whole and own parts, on another mesh or before the "
                "cut); the buffers reduced now start afresh (residual, iteration count, compressor state)",
                stale,
            )
        for key in stale:
            self._forget(key)

    def clear_state(self) -> None:
        """Forget every buffer's residual, iteration count and compressor state (a fresh start)."""
        self.error_feedback.clear()
        self.step_log.settle()
        self._states.clear()
        self._steps.clear()
        self._numels.clear()
        self._restored.clear()
        self._discarded = []

    def _check_size(self, key: str, n: int) -> None:
        expected = self._numels.setdefault(key, n)
        if expected == n:
            return
        if key in self._states:  # reduced in this run, not restored: the caller's key names two buffers
            raise StrategyError(
                f"compressed reducer: buffer {key!r} was reduced with {expected} elements, now {n}: a key "
                "must name the same buffer at every call (its error-feedback residual is kept per element)"
            )
        if self.backend.rank == 0:
            logging.getLogger(__name__).warning(
                "compressed reducer: restored state of buffer %r was for %d elements, the buffer now has %d "
                "(another bucket layout); its residual, iteration count and compressor state start afresh",
                *(key, expected, n),
            )
        self._forget(key)
        self._numels[key] = n

    def _forget(self, key: str) -> None:
        self.error_feedback.forget(key)
        for d in (self._states, self._steps, self._restored, self._numels):
            d.pop(key, None)

    # ------------------------------------------------------------------ internals
    def _check(self, key: str, grad: torch.Tensor, shard: torch.Tensor | None) -> None:
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            what = grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise TypeError(
                f"compressed reducer: gradient {key!r} must be a floating-point tensor, got {what}"
            )
        if grad.numel() == 0:
            raise ValueError(
                f"compressed reducer: gradient {key!r} is empty (0 elements); pass only non-empty buffers"
            )
        if not grad.is_contiguous():
            raise ValueError(f"compressed reducer: gradient {key!r} must be contiguous")
        p = self.backend.world_size
        if shard is not None and grad.numel() != p * shard.numel():
            raise ValueError(
                f"compressed reducer: reduce_scatter of {key!r} needs grad.numel() == world_size * "
                f"shard.numel(), got {grad.numel()} != {p} * {shard.numel()}"
            )

    def _dense_bytes(self, grad: torch.Tensor, shard: torch.Tensor | None) -> int:
        p, n = self.backend.world_size, grad.numel() * grad.element_size()
        return (p - 1) * n // p if shard is not None else 2 * (p - 1) * n // p

    def _run(self, key: str, grad: torch.Tensor, shard: torch.Tensor | None) -> Work:
        self._refuse_discarded("the next reduction")
        n = grad.numel()
        parts = None if self._all_dense else self.tp_parts.split(key, n, grad.device)
        if parts is None or n < self.dense_below:
            return self._run_one(key, grad, shard)
        flat = grad.view(-1)  # each part all-reduced as a buffer of its own, then written back
        for suffix, index in zip((WHOLE, OWN), parts, strict=True):
            part = flat.index_select(0, index)
            # a part too small for one element at the density (the bucket whole was not) goes dense
            small = isinstance(self.compressor, SparseCompressor) and self.compressor.k(part.numel()) < 1
            self._run_one(key + suffix, part, None, dense=small).wait()
            flat.index_copy_(0, index, part)
        if shard is not None:
            m = shard.numel()
            shard.view(-1).copy_(flat[self.backend.rank * m : (self.backend.rank + 1) * m])
        return CompletedWork()

    def _run_one(self, key: str, grad: torch.Tensor, shard: torch.Tensor | None, dense: bool = False) -> Work:
        stats, t0 = self.backend.stats, time.perf_counter()
        sent0, recv0 = stats.bytes_sent, stats.bytes_received
        n = grad.numel()
        if dense or self._all_dense or n < self.dense_below:
            if self.momentum_correction is not None:
                self.step_log.before(key)
                self._touched.append(key)
            self.error_feedback.momentum_step(key, grad)
            work = (
                self._dense.all_reduce(key, grad)
                if shard is None
                else self._dense.reduce_scatter(key, grad, shard)
            )
            self._record(n, None, grad, shard, sent0, recv0, t0, dense=True)
            return work
        self.compressor.validate_numel(n, key)
        self._check_size(key, n)
        self.step_log.before(key)
        state = self._states.get(key)
        if state is None:
            layout = self.layouts.get(key)
            state = self._states[key] = self.compressor.new_state_for_layout(key, n, layout)
            state.update(self._restored.pop(key, {}))
        step = self._steps.get(key, 0)
        warmup = self.compressor.warmup_steps
        warm = step < warmup
        compressor = self.compressor.at_step(max(0, step - warmup))
        # a magnitude-selecting compressor's selection is made in the error-feedback pass itself
        pre = None if warm else compressor.prefilter(state, n)
        if pre is not None:  # all-reduce: the gradient receives the result, so the pass may zero it
            pre.zero_source, pre.source_zeroed = shard is None, False
        acc, bad = self.error_feedback.accumulate_counted(key, grad, pre)
        if bad is None:  # a sum is finite unless a value is NaN/Inf (or it overflows: then count exactly)
            bad = 0 if bool(torch.isfinite(acc.sum())) else int((~torch.isfinite(acc)).sum())
        check = FiniteCheck(bad, lambda per_rank: self._nonfinite(key, per_rank))
        try:
            if warm:
                check.exchange(self.backend)
                ex = dense_exchange(acc, self.backend, shard is not None)
            else:
                ex = compressor.checked_exchange(state, acc, self.backend, check, shard=shard is not None)
        except ExchangeSkipped:
            self.error_feedback.discard(key, acc)
            (grad if shard is None else shard).fill_(float("nan"))
            return CompletedWork()
        self._touched.append(key)  # the exchange ran: the residual and iteration count change below
        if not check.decided:
            raise DtlabError(
                f"{type(compressor).__name__}.checked_exchange returned without deciding the non-finite "
                "check of its call; call check.exchange(backend) (or check.decide with every rank's "
                "count) before any payload moves"
            )
        out = grad.view(-1) if shard is None else shard.view(-1)
        ex.write(out, zeroed=pre is not None and pre.source_zeroed)
        if self.compressor.error_feedback:
            self.error_feedback.update(key, acc, ex.contributed, ex.sent, ex.residual_in_place)
        else:
            self.error_feedback.discard(key, acc, keep_velocity=True)
        self._steps[key] = step + 1
        self._record(n, ex, grad, shard, sent0, recv0, t0, dense=warm)
        return CompletedWork()

    def _nonfinite(self, key: str, per_rank: list[int]) -> None:
        """Every rank's NaN/Inf counts of ``key`` (some nonzero): recorded, raised under "raise"."""
        where = ", ".join(f"rank {r}: {c}" for r, c in enumerate(per_rank) if c)
        self._stats.nonfinite_values += sum(per_rank)
        self._stats.nonfinite_keys.append(key)
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"gradient {key!r} holds non-finite values (NaN/Inf) ({where}); nothing was sent and "
                f"the error-feedback residual was left unchanged. Lower the learning rate or enable "
                f"loss scaling, or pass nonfinite='skip' to hand NaN gradients to a NaN guard",
                key,
                per_rank,
            )

    def _record(
        self,
        n: int,
        ex: Exchange | None,
        grad: torch.Tensor,
        shard: torch.Tensor | None,
        sent0: int,
        recv0: int,
        t0: float,
        dense: bool,
    ) -> None:
        stats = self.backend.stats
        self._stats.add(
            numel=n,
            local_selected=n if ex is None else ex.local_selected,
            global_selected=n if ex is None else ex.global_selected,
            bytes_sent=stats.bytes_sent - sent0,
            bytes_received=stats.bytes_received - recv0,
            dense_bytes=self._dense_bytes(grad, shard),
            select_seconds=0.0 if ex is None else ex.select_seconds,
            total_seconds=time.perf_counter() - t0,
            dense=dense,
            sharded=shard is not None,
        )
