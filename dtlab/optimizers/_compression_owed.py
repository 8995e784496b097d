"""Parameters that no rank used in a step but that error feedback still owes an update.

Under ``find_unused_parameters=True`` a parameter no rank computed a gradient for is left out of the
optimizer step, as torch skips a ``.grad`` of None. Under lossy compression its error-feedback residual
may still hold gradient of earlier steps, and the step's exchange sends (and removes from the residual)
part of it: skipping the parameter would drop that update for good. :class:`OwedParams` keeps, after
every step, which parameters have a nonzero residual on this rank; before the next step a parameter
that is both skipped and owed is refused on every rank (the decision agreed by one all-reduce, only
in a step that skips a parameter)."""

from __future__ import annotations

import torch

from dtlab.backends.base import ReduceOp
from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.errors import StrategyError
from dtlab.models.base import ModelStrategy, OptimizerTarget

__all__ = ["OwedParams"]


class OwedParams:
    """Which trainable parameters of ``model`` have a nonzero residual in ``feedback``."""

    def __init__(self, model: ModelStrategy, feedback: ErrorFeedback) -> None:
        self.feedback = feedback
        #: ``(id(param), name, buffer key, offset, numel)`` of every parameter in a flat buffer of a
        #: data-parallel model with ``find_unused_parameters=True`` (none for any other model)
        self._slots: list[tuple[int, str, str, int, int]] = []
        self.model: OptimizerTarget | None = None
        if not (isinstance(model, OptimizerTarget) and getattr(model, "find_unused_parameters", False)):
            return
        try:
            units = model.shard_units()
        except StrategyError:  # a model without flat buffers: nothing is compressed per parameter slot
            return
        self.model = model
        by_name = dict(model.trainable_parameters())
        for u in units:
            for s in u.slots:
                if s.name in by_name:
                    self._slots.append((id(by_name[s.name]), s.name, u.key, s.offset, s.numel))
        self._owed: set[int] = set()

    def record(self) -> None:
        """After a step: the parameters whose residual (the next step's carry-over) is nonzero here
        (one device-to-host transfer for all of them)."""
        ids, flags = [], []
        for pid, _, key, offset, numel in self._slots:
            res = self.feedback.residual(key)
            if res is not None and res.numel() >= offset + numel:
                ids.append(pid)
                flags.append(res[offset : offset + numel].any())
        nonzero = torch.stack(flags).tolist() if flags else []
        self._owed = {pid for pid, owed in zip(ids, nonzero, strict=True) if owed}

    def check(self, who: str) -> None:
        """Before a step: refuse when a parameter the step skips (no rank used it) is owed on any rank.
        A step without a synchronized backward is refused first as the model refuses it (``who``: the
        optimizer strategy), not as skipping every parameter."""
        if self.model is None:
            return
        skipped = self.model.unused_params()  # the same on every rank: so is whether to agree below
        if not skipped or not self._slots:
            return
        self.model.check_grads_ready(who)
        names = [name for pid, name, *_ in self._slots if pid in skipped and pid in self._owed]
        flag = torch.tensor([float(bool(names))], dtype=torch.float64, device=self.model.dp_backend.device)
        self.model.dp_backend.all_reduce(flag, ReduceOp.MAX)
        if not bool(flag[0]):
            return
        raise StrategyError(
            f"gradient compression with error feedback and find_unused_parameters=True: no rank used "
            f"{sorted(set(names)) or 'some parameter(s) (named on another rank)'} in this step, so the "
            "step skips them (as torch skips a .grad of None), but their error-feedback residual still "
            "held gradient of earlier steps, which this step's exchange sent and the skip would drop. "
            "Call opt.zero_grad(set_to_none=False) instead (a parameter that had a gradient is then "
            "stepped with its synchronized gradient, residual included, as torch steps a zeroed .grad)"
        )
