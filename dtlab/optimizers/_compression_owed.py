"""Parameters that no rank used in a step but that error feedback still owes an update.

Under ``find_unused_parameters=True`` a parameter no rank computed a gradient for is left out of the
optimizer step, as torch skips a ``.grad`` of None. Under lossy compression its error-feedback residual
may still hold gradient of earlier steps, and the step's exchange sends (and removes from the residual)
part of it: skipping the parameter would drop that update for good. :class:`OwedParams` keeps, after
every step, which parameters have a nonzero residual on this rank; before the next step a parameter
that is both skipped and owed is refused on every rank (the decision agreed by an all-reduce over dp,
and over tp on a tensor-parallel mesh, where each tp rank's residuals differ, only in a step that skips
a parameter). Under momentum correction a skipped parameter's velocity is put back as it was before
the step (a dense step decayed it: torch leaves a skipped parameter's momentum buffer alone). A buffer
cut in two under tensor parallelism (:mod:`dtlab.compression.tp_parts`) keeps
its residual as two parts: each parameter is read in the part that holds it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.compression.tp_parts import OWN, WHOLE
from dtlab.errors import StrategyError
from dtlab.models.base import ModelStrategy, OptimizerTarget

__all__ = ["OwedParams"]


class OwedParams:
    """Which trainable parameters of ``model`` have a nonzero residual in ``feedback``; ``tp_whole``:
    the reducer's cut buffers (``TpParts.ranges``: key to the ``(offset, numel)`` of its whole part)."""

    def __init__(
        self, model: ModelStrategy, feedback: ErrorFeedback, tp_whole: Mapping[str, Sequence[tuple[int, int]]]
    ) -> None:
        self.feedback = feedback
        #: ``(id(param), name, residual key, offset, numel)`` of every parameter in a flat buffer of a
        #: data-parallel model with ``find_unused_parameters=True`` (none for any other model); the key
        #: and offset are those of the part holding it where its buffer is cut in two
        self._slots: list[tuple[int, str, str, int, int]] = []
        self.model: OptimizerTarget | None = None
        self._tp: CommunicationBackend | None = None  # the tp group on a tensor-parallel mesh
        if not (isinstance(model, OptimizerTarget) and getattr(model, "find_unused_parameters", False)):
            return
        try:
            units = model.shard_units()
        except StrategyError:  # a model without flat buffers: nothing is compressed per parameter slot
            return
        self.model = model
        tp = getattr(model, "tp_group", None)
        if isinstance(tp, CommunicationBackend) and tp.world_size > 1:
            self._tp = tp
        by_name = dict(model.trainable_parameters())
        for u in units:
            for s in u.slots:
                if s.name in by_name:
                    key, offset = _part_of(u.key, s.offset, tp_whole.get(u.key))
                    self._slots.append((id(by_name[s.name]), s.name, key, offset, s.numel))
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
        if self._tp is not None:  # each tp rank's residuals differ: every rank of the stage agrees
            self._tp.all_reduce(flag, ReduceOp.MAX)
        if not bool(flag[0]):
            for pid, _, key, offset, numel in self._slots:  # momentum correction: torch leaves the
                if pid in skipped:  # momentum of a skipped parameter alone, so does its velocity
                    self.feedback.keep_velocity(key, offset, numel)
            return
        raise StrategyError(
            f"gradient compression with error feedback and find_unused_parameters=True: no rank used "
            f"{sorted(set(names)) or 'some parameter(s) (named on another rank)'} in this step, so the "
            "step skips them (as torch skips a .grad of None), but their error-feedback residual still "
            "held gradient of earlier steps, which this step's exchange sent and the skip would drop. "
            "Call opt.zero_grad(set_to_none=False) instead (a parameter that had a gradient is then "
            "stepped with its synchronized gradient, residual included, as torch steps a zeroed .grad)"
        )


def _part_of(key: str, offset: int, whole: Sequence[tuple[int, int]] | None) -> tuple[str, int]:
    """The residual key and offset of the parameter at ``offset`` in buffer ``key``: the buffer's own
    where it is compressed whole (``whole`` None), else the part holding it (the whole part packs its
    ranges in order, the own part the rest)."""
    if whole is None:
        return key, offset
    before = sum(num for off, num in whole if off < offset)  # whole-part elements before this parameter
    if any(off == offset for off, _ in whole):
        return key + WHOLE, before
    return key + OWN, offset - before
