"""``SplitDraws``: dropout between a column-parallel layer and its row-parallel partner draws masks of
this tp rank's own, as Megatron-LM's model-parallel RNG stream does.

Every tp rank of a replica draws from one stream (a launched rank's process is seeded with
``train.seed + 1 + rank // tp``; an in-memory rank's generator alike): right where the tp ranks hold the
same activations (dropout on the residual stream must draw the same mask on each), wrong between a
column-parallel layer and its row-parallel partner, where each rank holds other heads or hidden units:
head ``h`` on rank 0 and head ``h + H/tp`` on rank 1 would get the same mask. So, in training mode, a
column-parallel layer's split output opens a *split region*, which its row-parallel partner's input
closes (and, whatever happens, the end of the smallest module holding both, and the model's own
end). Inside it a :class:`~dtlab.core.random_ops.GeneratorMode` hands each CPU random op called without
a generator (``F.dropout``, ``nn.Dropout``, ``scaled_dot_product_attention(dropout_p=...)`` on the
CPU) a generator
seeded with ``s + tp_rank``, where ``s`` is one number drawn from the replicated stream at the region's
first random op: the same ``s`` on every tp rank, so the replicated stream stays the same on every tp
rank, and nothing new to save (a resume restores the replicated stream; an activation checkpoint's
recomputation draws the same ``s`` again, so the same masks). A region that draws nothing draws no
``s``: a model without dropout trains bit for bit as before, and a region whose first training pass
drew nothing is not opened again (the mode sees every op it runs: a small op's dispatch costs about
twice as much under it) until the model's settings change
(:class:`~dtlab.core.settings_watch.SettingsWatch`: a module's ``train()``/``eval()``, a module added
or replaced, a dropout's ``p``), looked at once per forward, at its first such region: then every region
decides again at its next training pass, so dropout raised after a warm-up draws the masks a run that
dropped from the start drew first. On a GPU no region opens (the ops draw from the device's replicated stream:
the masks of the tp ranks' heads agree), and a CPU op that takes no generator (``torch.native_dropout``)
runs as called: see docs/strategies.md, "Dropout under tensor parallelism".
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload

from dtlab.core.random_ops import GeneratorMode, OpPlan, draw_seed
from dtlab.core.settings_watch import SettingsWatch
from dtlab.core.torch_private import top_dispatch_mode
from dtlab.errors import StrategyError
from dtlab.models.tensor._layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["SplitDraws"]


class _SplitMode(GeneratorMode):
    """The CPU random ops of one split region draw from a generator seeded with ``s + tp_rank``."""

    def __init__(self, tp_rank: int, plans: dict[OpOverload, OpPlan], opener: nn.Module) -> None:
        super().__init__(plans)
        self.tp_rank, self.opener = tp_rank, opener
        self.cpu: torch.Generator | None = None

    def generator(self, func: OpOverload, device: torch.device) -> torch.Generator | None:  # noqa: ARG002 - GeneratorMode's interface
        if device.type != "cpu":
            return None
        if self.cpu is None:  # this mode is off while it runs: ``s`` comes from the stream below it
            self.cpu = torch.Generator().manual_seed(draw_seed() + self.tp_rank)
        return self.cpu

    def refused(self, func: OpOverload, device: torch.device) -> Exception | None:  # noqa: ARG002 - GeneratorMode's interface
        return None  # as called: the stream below (an in-memory rank's mode refuses it on the CPU)


class SplitDraws:
    """The split regions of one model: :meth:`install` hooks each column-parallel layer (split output)
    followed, in the order the modules were registered, by a row-parallel layer (split input) under a
    common module (not a head left split: nothing closes its region but the end of the whole model,
    which a pipeline stage never runs)."""

    def __init__(self, root: nn.Module | None = None) -> None:
        self.plans: dict[OpOverload, OpPlan] = {}
        self.mode: _SplitMode | None = None
        #: column-parallel layers whose region's first training pass was seen, and those of them whose
        #: region drew nothing then (not opened again: no per-op cost for a model without dropout)
        self.seen: set[int] = set()
        self.quiet: set[int] = set()
        #: the model's settings as they were when a region last decided; quiet openers met since the
        #: last look at them (one met again: the next forward, looked at again)
        self.watch = None if root is None else SettingsWatch(root)
        self.met: set[int] = set()

    def install(self, root: nn.Module) -> None:
        self.watch = SettingsWatch(root)
        order = {id(m): i for i, m in enumerate(root.modules())}
        rows = [m for m in root.modules() if isinstance(m, RowParallelLinear) and m.input_is_parallel]
        holders: dict[str, nn.Module] = {}
        for name, m in root.named_modules():
            if not isinstance(m, ColumnParallelLinear) or m.gather_output:
                continue
            parts = name.split(".")
            for cut in range(len(parts) - 1, -1, -1):  # the smallest module holding a partner after it
                path = ".".join(parts[:cut])
                holder = root.get_submodule(path)
                inside = {id(x) for x in holder.modules()}
                if any(id(r) in inside and order[id(r)] > order[id(m)] for r in rows):
                    m.register_forward_hook(self._open)
                    holders[path] = holder
                    break
        for r in rows:
            r.register_forward_pre_hook(self._close)
        if holders and "" not in holders:  # the model's own end too: a parent calling the layers itself
            holders[""] = root
        for holder in holders.values():
            holder.register_forward_hook(self._close, always_call=True)

    def _open(self, layer: nn.Module, _inputs: Any, output: Any) -> None:
        if self.mode is not None or not layer.training:
            return
        if torch.compiler.is_compiling() or (isinstance(output, torch.Tensor) and not output.is_cpu):
            return
        if id(layer) in self.quiet and not self._reopened(id(layer)):
            return
        group = layer.group if isinstance(layer, ColumnParallelLinear) else None
        if group is None or group.world_size == 1:
            return
        self.mode = _SplitMode(group.rank, self.plans, layer)
        self.mode.__enter__()  # type: ignore[no-untyped-call,unused-ignore]

    def _close(self, layer: nn.Module, *_args: Any) -> None:
        mode = self.mode
        if mode is None:
            return
        top = top_dispatch_mode()
        if top is not mode:
            raise StrategyError(
                f"tensor parallelism: {type(top).__name__}, a torch dispatch mode entered between a "
                f"column-parallel layer's output and {type(layer).__name__}'s input (a split region, "
                "whose dropout draws this tp rank's own masks), is still active where the region ends; "
                "enter and leave it within the region, or around the whole module"
            )
        self.mode = None
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call,unused-ignore]
        opener = id(mode.opener)
        if opener not in self.seen and sys.exc_info()[1] is None:  # its first whole training pass decides
            quiet = mode.cpu is None
            # the settings it decides under; quiet regions that decided under others decide again
            if quiet and self.watch is not None and self.watch.changed():
                self._forget()
            self.seen.add(opener)
            if quiet:
                self.quiet.add(opener)

    def _reopened(self, opener: int) -> bool:
        """Whether the quiet region of ``opener`` opens again: the model's settings changed since the
        regions decided (looked at by the first quiet region of each forward: one met twice, or none met
        since the last look, begins a forward)."""
        if self.met and opener not in self.met:
            self.met.add(opener)
            return False
        self.met = {opener}
        if self.watch is None or not self.watch.changed():
            return False
        self._forget()
        return True

    def _forget(self) -> None:
        """Every region decides again at its next training pass."""
        self.seen.clear()
        self.quiet.clear()
        self.met.clear()

    def __reduce__(self) -> tuple[type[SplitDraws], tuple[nn.Module | None]]:
        # a copied model: no region open; the copy's settings watched (its root, copied with it)
        return type(self), (None if self.watch is None else self.watch.model,)
