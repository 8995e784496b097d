"""Meta-device construction under the model-parallel composition (tensor, pipeline, hybrid).

The whole model is built on the meta device and laid out (tensor plan swapped on meta, this rank's
stages kept). :class:`MetaWalk` then walks the *original* modules of the whole model in registration
order inside ``seeded_init(init_seed)``, one at a time: its own tensors are made whole on the CPU,
initialized and checked by ``dtlab.models.dp._materialize.MetaFill``, and only what this rank holds is
kept (the tp slice of a tensor of its own stages). Every rank draws the whole model's numbers in the
order a plain construction draws them, so the result is bitwise the model built plainly under
``seeded_init(init_seed)`` and wrapped. Under DDP, ZeRO-1/2 :meth:`MetaWalk.run` swaps the values into
this rank's tensors before the strategy wraps the module; under ZeRO-3/FSDP the strategy's own meta
construction calls :meth:`MetaWalk.fill` as its ``param_init_fn`` (in the same module order) and keeps
only its flat shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Placement, Shard, placement_of
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models.dp._materialize import MetaFill, OwnTensor, ParamInitFn, own_tensors

__all__ = ["MetaWalk"]


@dataclass
class _Entry:
    """One module of the whole model with tensors of its own on meta (parameters, meta buffers)."""

    name: str
    module: nn.Module
    tensors: list[OwnTensor]  #: the original meta tensors


@dataclass(frozen=True)
class _Target:
    """Where this rank keeps a tensor: the module of its root holding it, the name, the placement."""

    module: nn.Module
    name: str
    placement: Placement


class MetaWalk:
    """The whole model's meta tensors, in registration order, and where this rank keeps each."""

    def __init__(self, who: str, module: nn.Module, seed: int, param_init_fn: ParamInitFn | None) -> None:
        self.how, self.seed = MetaFill(who, module, param_init_fn), seed
        self.entries: list[_Entry] = []
        for mname, mod in module.named_modules():
            if own := own_tensors(mod):
                self.entries.append(_Entry(mname or "<root>", mod, own))
        self.targets: dict[tuple[int, str], _Target] = {}
        self.wanted: dict[int, list[int]] = {}  # id(root module) -> entries that feed it
        self.tp_rank, self.tp_size = 0, 1
        self.next = 0  # the next entry to initialize
        self.done: set[int] = set()  # ids of original tensors already initialized
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # by module id: values ZeRO-3/FSDP asks later

    def bind(self, root: nn.Module, swapped: dict[int, torch.Tensor], tp: CommunicationBackend) -> None:
        """Where this rank keeps each original tensor: in ``root`` (its stages, after the tensor plan),
        ``swapped`` mapping an original tensor to the tensor-parallel parameter that replaced it."""
        index: dict[int, tuple[nn.Module, str]] = {}
        for mod in root.modules():
            for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                index.setdefault(id(t), (mod, n))
        for i, entry in enumerate(self.entries):
            for n, t, _ in entry.tensors:
                new = swapped.get(id(t), t)
                hit = index.get(id(new))
                if hit is not None:
                    self.targets[(i, n)] = _Target(hit[0], hit[1], placement_of(new))
                    self.wanted.setdefault(id(hit[0]), []).append(i)
        self.tp_rank, self.tp_size = tp.rank, tp.world_size

    def run(self, root: nn.Module, device: torch.device) -> None:
        """Walk every module; this rank's tensors (in ``root``) get their values, swapped in on
        ``device``; none may be left on meta (each is named)."""
        with torch.no_grad(), seeded_init(self.seed):
            for i in range(len(self.entries)):
                self._step(i, None, device)
        left = [n for n, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
        if left:
            raise StrategyError(
                f"{self.how.who}: {left[:4]} of this rank were built on the meta device and nothing gave "
                "them values; pass param_init_fn=fn that fills them, or build them on the real device"
            )

    def fill(self, mod: nn.Module) -> None:
        """The ``param_init_fn`` given to ZeRO-3/FSDP (inside their ``seeded_init``): advance the walk to
        the last module feeding ``mod`` and fill ``mod``'s own tensors (the strategy's whole buffers)."""
        feeding = self.wanted.get(id(mod), [])
        with torch.no_grad():
            while feeding and self.next <= max(feeding):
                self._step(self.next, mod, None)
                self.next += 1
            for name, value in self.pending.pop(id(mod), {}).items():
                getattr(mod, name).copy_(value)

    def _own_values(self, i: int) -> bool:
        """Whether entry ``i``'s tensors are all kept whole in the module itself (nothing to slice)."""
        entry = self.entries[i]
        for n, t, _ in entry.tensors:
            target = self.targets.get((i, n))
            if id(t) in self.done or target is None:
                return False
            if target.module is not entry.module or target.name != n or isinstance(target.placement, Shard):
                return False
        return True

    def _step(self, i: int, asking: nn.Module | None, device: torch.device | None) -> None:
        entry = self.entries[i]
        if asking is not None and asking is entry.module and self._own_values(i):
            init = self.how.initializer(entry.name, entry.module, entry.tensors[0][0])
            init(entry.module)  # the strategy's whole buffers, checked by the strategy
            self.done.update(id(t) for _, t, _ in entry.tensors)
            return
        for (n, _, _), value in self.how.init_checked(entry.name, entry.module, entry.tensors, self.done, {}):
            target = self.targets.get((i, n))
            if target is not None:
                copied_now = device is None and target.module is asking  # copied, not kept
                self._deliver(target, self._local(value, target.placement, copied_now), asking, device)

    def _local(self, whole: torch.Tensor, placement: Placement, copied_now: bool) -> torch.Tensor:
        if not isinstance(placement, Shard):
            return whole
        part = placement.local_shard(whole, self.tp_rank, self.tp_size)
        same = part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        return part.clone() if same and not copied_now else part  # a kept view would keep the whole

    def _deliver(
        self, target: _Target, value: torch.Tensor, asking: nn.Module | None, device: torch.device | None
    ) -> None:
        current = getattr(target.module, target.name)
        if device is None:  # ZeRO-3/FSDP: into the strategy's whole buffer of that module
            if target.module is asking:
                current.copy_(value)
            else:  # asked for later (the strategy walks the same order; kept until then)
                self.pending.setdefault(id(target.module), {})[target.name] = value
            return
        value = value.to(device)
        if isinstance(current, nn.Parameter):
            attrs = dict(current.__dict__)
            torch.utils.swap_tensors(current, nn.Parameter(value, requires_grad=current.requires_grad))
            current.__dict__.update(attrs)  # the placement stays on the (same) parameter object
        else:
            setattr(target.module, target.name, value)
