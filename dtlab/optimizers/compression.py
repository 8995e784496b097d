"""``GradientCompressionOptimizer``: compressed gradient exchange under any optimizer strategy.

::

    model = ZeRO2Model(net, backend)
    opt = GradientCompressionOptimizer(ZeRO2Optimizer(model, torch.optim.AdamW, lr=1e-3),
                                       compressor=OkTopk(density=0.01))

It swaps the model strategy's gradient reducer for a :class:`~dtlab.compression.CompressedReducer`
on the model's data-parallel group and otherwise delegates everything to the inner optimizer
strategy: it changes how gradients travel, not what the strategy does. With DDP (and ZeRO-1 built
with ``gradient_sync="all_reduce"``) the reducer is used with all-reduce semantics; with ZeRO-2/3,
FSDP and ZeRO-1's default ``gradient_sync="reduce_scatter"`` with reduce-scatter semantics (each
owner receives its shard from the sparse reduce; Ok-Topk's and TopkDSA's gather phase is skipped).
The dense path (``Dense``, small buffers) keeps the strategy's ``reduce_dtype``.
``statistics`` holds the last step's compression figures (density, bytes, ratio, times).

``momentum_correction=0.9`` applies Deep Gradient Compression's momentum correction and momentum
factor masking (Lin et al., ICLR 2018) inside the error feedback: each rank keeps a velocity
``u = m * u + grad`` and accumulates ``v += u`` (the residual), sends the compressor's selection of
``v`` and zeroes ``u`` and ``v`` where it sent. The inner optimizer then only applies the averaged
update: it must be ``torch.optim.SGD`` with ``momentum=0``. Its weight decay gets a velocity of its
own in the optimizer state (``momentum_buffer``, :mod:`dtlab.optimizers._decay_velocity`), as in DGC's
reference optimizer, and a sparse compressor at ``density=1.0`` sends dense (masking would zero the
whole velocity), so without compression (dense path, warm-up, density 1.0) this is torch's
``SGD(momentum=m, weight_decay=wd)`` on the global batch. ``clip_grad_norm_`` then clips (and measures)
the synchronized velocity, the update after the momentum: one process clips the gradient before it.
It is meant for the sparse algorithms: the dense-shaped compressors (PowerSGD, QSGD, casts) send no
index set, so their velocity is never masked (measured: PowerSGD +9.2% LM perplexity with it, +1.1%
with the optimizer's momentum; docs/compression.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtlab.compression.base import Compressor, Layout
from dtlab.compression.dense import Dense
from dtlab.compression.oktopk import OkTopk
from dtlab.compression.reducer import CompressedReducer, NonFinitePolicy
from dtlab.core.reducer import DenseReducer, GradientReducer
from dtlab.core.state import ShardedState, tensors_where
from dtlab.errors import StrategyError
from dtlab.models.base import ModelStrategy
from dtlab.optimizers._compression_owed import OwedParams
from dtlab.optimizers._compression_resize import averaged_state
from dtlab.optimizers._decay_velocity import decay_with_momentum
from dtlab.optimizers.base import OptimizerStrategy, WrappingStrategy

__all__ = ["GradientCompressionOptimizer"]

#: name prefix of the compression tensors in this strategy's shard
PREFIX = "compression."


def _not_compression(name: str) -> bool:
    return not name.startswith(PREFIX)


def bucket_layouts(model: ModelStrategy) -> dict[str, Layout]:
    """``{buffer key: (offset, shape) of its parameters}`` for every flat buffer the model reduces
    (DDP/ZeRO-1/ZeRO-2 buckets, ZeRO-3 parameters, FSDP units); empty for a model without them."""
    shard_units = getattr(model, "shard_units", None)
    if shard_units is None:
        return {}
    try:
        units = shard_units()
    except StrategyError:
        return {}
    return {u.key: [(s.offset, tuple(s.shape)) for s in u.slots] for u in units}


def tp_whole_ranges(model: ModelStrategy) -> dict[str, list[tuple[int, int]]]:
    """``{buffer key: (offset, numel) of its parameters every tp rank holds whole}`` for the buffers
    that also hold tp shards (a model on a mesh with tp > 1); empty for any other model."""
    same: frozenset[str] = getattr(model, "same_grad_over_tp", frozenset())
    shard_units = getattr(model, "shard_units", None)
    if not same or shard_units is None:
        return {}
    out = {}
    for u in shard_units():
        whole = [(s.offset, s.numel) for s in u.slots if s.name in same]
        if whole and len(whole) < len(u.slots):
            out[u.key] = whole
    return out


def check_plain_sgd(optimizer: torch.optim.Optimizer, momentum_correction: float) -> None:
    """Momentum correction replaces the optimizer's momentum: only SGD without momentum fits."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise StrategyError(
            f"momentum_correction={momentum_correction} keeps the momentum in the compressed "
            f"reducer, so the inner optimizer must be torch.optim.SGD with momentum=0, got "
            f"{type(optimizer).__name__} (which has its own momentum/moments); use "
            f"DDPOptimizer(model, torch.optim.SGD, lr=..., momentum=0), or drop momentum_correction"
        )
    refuse_momentum(optimizer.param_groups, momentum_correction, at_step=False)


def refuse_momentum(groups: list[dict[str, Any]], momentum_correction: float, at_step: bool) -> None:
    """The inner SGD must keep momentum=0: at construction, and at every step (a scheduler with
    ``cycle_momentum``, OneCycleLR's and CyclicLR's default, or ``add_param_group`` may set it)."""
    for i, group in enumerate(groups):
        if group.get("momentum", 0) != 0 or group.get("nesterov", False):
            how = (
                " at this step (a scheduler with cycle_momentum=True, the default of OneCycleLR and "
                "CyclicLR, or add_param_group set it; build the scheduler with cycle_momentum=False)"
                if at_step
                else ""
            )
            raise StrategyError(
                f"momentum_correction={momentum_correction} with an SGD that has momentum="
                f"{group.get('momentum')} (nesterov={group.get('nesterov')}) in param group {i}{how} "
                f"would apply momentum twice; build the inner SGD with momentum=0 (the reducer "
                f"applies momentum {momentum_correction})"
            )


class GradientCompressionOptimizer(WrappingStrategy):
    """Wrap ``inner`` (any optimizer strategy) so its model's gradients travel compressed."""

    strategy_name = "compression"

    def __init__(
        self,
        inner: OptimizerStrategy,
        compressor: Compressor | None = None,
        *,
        dense_below: int = 1024,
        nonfinite: NonFinitePolicy = "raise",
        momentum_correction: float | None = None,
    ) -> None:
        if not isinstance(inner, OptimizerStrategy):
            raise TypeError(
                "GradientCompressionOptimizer wraps an optimizer strategy such as "
                f"DDPOptimizer(model, torch.optim.SGD, lr=0.1), got {type(inner).__name__}"
            )
        if isinstance(inner, GradientCompressionOptimizer):
            raise StrategyError(
                "GradientCompressionOptimizer is already applied; wrap the inner strategy once"
            )
        self._undecay: Callable[[], None] | None = None
        if momentum_correction is not None:
            check_plain_sgd(inner.optimizer, momentum_correction)
            self._undecay = decay_with_momentum(inner.optimizer, momentum_correction)
        self.inner = inner
        self.model = inner.model
        self.compatible_models = inner.compatible_models  # type: ignore[misc]
        self.compressor = compressor if compressor is not None else OkTopk(density=0.01)
        self._previous: GradientReducer = self.model.gradient_reducer
        # the dense path (Dense, small buffers, warm-up of the plain reducer) keeps the strategy's
        # reduce_dtype, so Dense through compression reproduces the strategy exactly
        reduce_dtype = self._previous.reduce_dtype if isinstance(self._previous, DenseReducer) else None
        self.reducer = CompressedReducer(
            self.model.dp_backend,
            self.compressor,
            dense_below=dense_below,
            nonfinite=nonfinite,
            reduce_dtype=reduce_dtype,
            layouts=bucket_layouts(self.model),
            momentum_correction=momentum_correction,
            tp_whole=tp_whole_ranges(self.model),
        )
        self.reducer.step_log.enabled = True  # this optimizer says which steps are applied
        self.model.gradient_reducer = self.reducer
        self.statistics: dict[str, Any] = {}
        self._owed = OwedParams(self.model, self.reducer.error_feedback, self.reducer.tp_parts.ranges)

    own_attributes = ("inner", "reducer", "model")  # the inner strategy's own helpers: read through

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:  # the backward first, so the check sees this step's unused parameters
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
        if self.reducer.momentum_correction is not None:
            refuse_momentum(self.param_groups, self.reducer.momentum_correction, at_step=True)
        self._owed.check(type(self.inner).__name__)
        self.inner.step()
        self.reducer.step_log.settle()
        self._owed.record()
        self.statistics = self.reducer.step_statistics()
        self.reducer.start_step()
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by ``torch.amp.GradScaler.step(opt)`` (torch's only reader): refused, as dtlab's
        ``GradScaler`` refuses compression (a ``torch.amp.GradScaler`` over sharded gradients is refused
        at ``unscale_`` already, over DDP's whole ones it is not)."""
        raise StrategyError(
            "torch.amp.GradScaler with gradient compression: the loss scale multiplies the gradients the "
            "compressor sees, so the error-feedback residuals keep them at the scale of their step and send "
            "them after the scale changed (grown, or lowered after an overflow), at another scale; use bf16 "
            "autocast (no loss scaling) or no compression"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; after gradients that were reduced but not stepped (a step skipped for a non-finite
        gradient on some rank) every buffer they went through gets back its error-feedback residual,
        momentum-correction velocity and iteration count (:mod:`dtlab.compression.skipped`), as one
        process skipping the step keeps nothing of its batch."""
        self.reducer.step_log.undo()
        self.inner.zero_grad(set_to_none)

    def own_memory(self) -> dict[str, int]:
        return {"compression_residuals": self.reducer.error_feedback.nbytes()}

    # ------------------------------------------------------------------ state
    def sharded_state_dict(self) -> ShardedState:
        """The inner state plus this rank's compression state: error-feedback residuals, iteration
        counts and the compressor's per-buffer state (tensors ``compression.*``, JSON
        ``metadata["compression"]``), with the world size and model strategy they belong to."""
        inner = self.inner.sharded_state_dict()
        tensors = dict(inner.tensors)
        own, meta = self.reducer.state_dict()
        tensors.update({PREFIX + k: v for k, v in own.items()})
        backend = self.model.world_backend  # on a mesh: one shard per rank of it
        metadata = dict(inner.metadata)
        metadata["compression"] = {
            "compressor": self.compressor.describe(),
            "world_size": backend.world_size,
            "dp_world_size": self.model.dp_backend.world_size,
            "rank": backend.rank,
            "model_strategy": self.model.strategy_name,
            **meta,
        }
        return ShardedState(tensors, metadata)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's: the inner optimizer's state in torch's layout, which holds no compression state. An
        optimizer that has reduced keeps its own (a round trip mid-run continues exactly); a fresh one
        starts afresh, dense warm-up included, and a warning says so: for an exact resume, save and
        load ``sharded_state_dict()`` (``dtlab.checkpoint``), which holds every rank's residuals."""
        self.inner.load_state_dict(state_dict)
        # decided alike on every rank from the iteration counts (no copy, no refusal after a backward
        # that raised partway, which would raise on the warning rank only)
        if isinstance(self.compressor, Dense) or self.reducer.has_reduced():
            return
        if self.model.world_backend.rank == 0:
            logging.getLogger(__name__).warning(
                "opt.load_state_dict() restored the torch optimizer state only: the compression state "
                "(error-feedback residuals, iteration counts and warm-up, the compressor's own state) "
                "is not in torch's layout and starts afresh; for an exact resume save and load "
                "opt.sharded_state_dict() (dtlab.checkpoint.save_checkpoint / read_checkpoint)"
            )

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load the inner state, then this rank's compression state when it was saved at this world
        size under this model strategy (a resume continues exactly); otherwise the compression state
        starts afresh (warm-up included) and a warning says why. Under another compressor
        configuration only residuals and iteration counts are restored."""
        stripped = []
        for s in shards:
            meta = {k: v for k, v in s.metadata.items() if k != "compression"}
            stripped.append(ShardedState(tensors_where(s.tensors, _not_compression), meta))
        self.inner.load_sharded_state_dict(stripped)
        self.reducer.clear_state()
        saved = [s.metadata.get("compression") for s in shards]
        if all(c is None for c in saved):
            return  # written without compression: nothing to restore
        backend = self.model.world_backend
        p, me = backend.world_size, backend.rank
        log = logging.getLogger(__name__)
        mine = saved[me] if len(shards) == p else None
        reason = None
        if len(shards) != p:
            reason = f"the checkpoint was written by {len(shards)} ranks, this run has {p}"
            if self._load_resized(shards, saved, reason):
                return
        elif not isinstance(mine, dict):
            reason = f"rank {me}'s shard holds no compression state"
        elif mine.get("model_strategy", self.model.strategy_name) != self.model.strategy_name:
            reason = (
                f"it was written under model strategy {mine.get('model_strategy')!r}, this run uses "
                f"{self.model.strategy_name!r} (another bucket layout)"
            )
        if reason is not None or not isinstance(mine, dict):
            if me == 0:
                log.warning(
                    "compression state not restored: %s; error-feedback residuals, compressor state "
                    "(thresholds, boundaries, factors, counters) and warm-up start afresh (per-rank "
                    "state is tied to the world size and bucket layout)",
                    reason,
                )
            return
        same = mine.get("compressor") == self.compressor.describe()
        if not same and me == 0:
            log.warning(
                "compressor state not restored: the checkpoint was written with %s, this run uses %s; "
                "error-feedback residuals and iteration counts are restored, the compressor's own "
                "state (thresholds, boundaries, factors) starts afresh",
                mine.get("compressor"),
                self.compressor.describe(),
            )
        mine_t = shards[me].tensors  # this rank's compression tensors only are read
        own = {k[len(PREFIX) :]: mine_t[k] for k in list(mine_t) if k.startswith(PREFIX)}
        self.reducer.load_state_dict(own, mine, compressor_state=same)
        self._owed.record()

    def _load_resized(self, shards: Sequence[ShardedState], saved: Sequence[Any], written: str) -> bool:
        """Another data-parallel world size: each rank restores the old ranks' mean residuals and
        velocities (:mod:`dtlab.optimizers._compression_resize`); False where that does not apply."""
        metas = [m for m in saved if isinstance(m, dict)]
        if len(metas) != len(saved) or any(
            m.get("model_strategy") != self.model.strategy_name for m in metas
        ):
            return False
        if self.model.world_backend.world_size != self.model.dp_backend.world_size:
            return False  # on a mesh: each rank's buffers are its own slices
        try:  # this run's buffers: a saved one is refitted where only its padding differs
            sizes = {u.key: (u.numel, u.padded) for u in getattr(self.model, "shard_units", list)()}
        except StrategyError:
            sizes = {}
        got = averaged_state(shards, PREFIX, metas, sizes)
        log = logging.getLogger(__name__)
        me = self.model.world_backend.rank
        if isinstance(got, str):
            if me == 0:
                log.warning("compression state not restored: %s; %s: it starts afresh", written, got)
            return True
        self.reducer.load_state_dict(*got, compressor_state=False)
        self._owed.record()
        if me == 0:
            log.warning(
                "compression state resharded: %s; every rank restores the mean of the %d ranks' "
                "error-feedback residuals and momentum-correction velocities (what they owe, and the "
                "momentum, are kept) and the iteration counts; the compressor's own state (thresholds, "
                "boundaries, factors) starts afresh",
                written,
                len(shards),
            )
        return True

    def remove(self) -> OptimizerStrategy:
        """Put the model's previous reducer back and return the inner optimizer strategy."""
        self.model.gradient_reducer = self._previous
        if self._undecay is not None:
            self._undecay()
        return self.inner
