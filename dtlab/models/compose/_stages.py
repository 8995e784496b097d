"""What the composition keeps about its pipeline stages besides the schedule:

- :class:`StageSpecs`: the tensors crossing stage boundaries for each micro-batch shape (a forward on
  the meta device for block stages; the checked trace for a model split at module names, whose stages
  are then told the traced block outputs their stubs return);
- :class:`TiedSync`: the weights tied across pipeline ranks kept in sync (their gradients summed over
  each tie group before the dp reduction, or after it where the strategy leaves whole averaged
  gradients) and counted once in the gradient norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from dtlab.models.dp.zero1 import ZeRO1Model
from dtlab.models.pipeline._split import Stage, TensorSpec
from dtlab.models.pipeline._split import stage_specs as meta_stage_specs
from dtlab.models.pipeline._ties import sum_tied
from dtlab.models.pipeline._trace import TracedStage
from dtlab.models.pipeline._trace_check import Trace, trace_split

if TYPE_CHECKING:
    from dtlab.models.compose._build import Layout
    from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["StageSpecs", "TiedSync"]


class StageSpecs:
    """Each stage's output spec per micro-batch shape, computed once per shape alike on every rank."""

    def __init__(self, layout: Layout, module: nn.Module) -> None:
        self.layout = layout
        self.__dict__["_module"] = module  # the user's whole module (other stages on meta)
        self._specs: dict[TensorSpec, list[TensorSpec]] = {}
        self._traces: dict[TensorSpec, Trace] = {}

    def __call__(self, sample: torch.Tensor, dp: DataParallelModel) -> list[TensorSpec]:
        key = TensorSpec(tuple(sample.shape), sample.dtype)
        layout = self.layout
        if key not in self._specs:
            with dp.gather_hooks_suspended():  # ZeRO-3/FSDP hold only shards at rest
                if layout.traced:
                    stages = cast("list[TracedStage]", layout.stages)
                    trace = trace_split(self.__dict__["_module"], stages, layout.whole_shapes, sample)
                    self._traces[key], self._specs[key] = trace, trace.specs
                else:
                    blocks = cast("list[Stage]", layout.stages)
                    self._specs[key] = meta_stage_specs(blocks, layout.shapes, key)
        if layout.traced:
            trace = self._traces[key]
            for stage in cast("list[TracedStage]", layout.stages):
                stage.prepare(trace.outputs, trace.slots.get(stage.entry or "", 0))
        return self._specs[key]


class TiedSync:
    """The weights tied across this rank's pipeline stages and other ranks' (see ``pipeline._ties``)."""

    def __init__(self, layout: Layout, root: nn.Module, dp: DataParallelModel) -> None:
        self.ties = layout.ties
        self.__dict__["_dp"] = dp
        held = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        aliases = layout.aliases
        #: a weight tied across ranks counts once in the norm, on the rank holding its first name
        self.norm_skip = {n for n in held if n in aliases and aliases[n] not in held}
        self._names = {id(p): n for n, p in root.named_parameters()}
        if self.ties:
            dp.register_post_sync_hook(self.after_reduce)

    def _after(self) -> bool:
        """Whether the copies are summed after the dp reduction (whole, averaged gradients: DDP and
        ZeRO-1 all-reducing) rather than before it (slices of the copies at different offsets)."""
        dp: DataParallelModel = self.__dict__["_dp"]
        if isinstance(dp, ZeRO1Model):
            return dp.gradient_sync == "all_reduce"
        return dp.keeps_whole_grads

    def before_reduce(self) -> None:
        """Before the dp reduction: each copy's local accumulated gradient summed over its group."""
        if self.ties and not self._after():
            sum_tied(self.ties, [None if t.param is None else t.param.grad for t in self.ties])

    def after_reduce(self) -> None:
        """After the dp average: each copy's whole gradient summed over its group."""
        if not self._after():
            return
        dp: DataParallelModel = self.__dict__["_dp"]
        grads = dict(dp.whole_grads())
        sum_tied(
            self.ties,
            [None if t.param is None else grads.get(self._names.get(id(t.param), "")) for t in self.ties],
        )
