"""In-place writes into ZeRO-3/FSDP parameters outside a forward (an init after wrapping).

Between uses a sharded parameter is parked (:meth:`FlatUnit.park`): a stand-in of its shape over one
NaN element of its unit's ``marker``, and the values live in each rank's shard. :class:`ParamWrites`
lands the writes made through the wrapper (``model.apply(fn)``, ``summon_full_params()``) in every
rank's shard, and refuses by name those made into a stand-in, which the next gather would drop
(``model.module.apply(fn)``, ``p.zero_()``), at the next use of the parameters. A parameter kept
gathered (ZeRO-3's persistent ones) takes any write, as under DDP: its shard is refreshed from it
before the optimizer or a checkpoint reads it (:meth:`ParamWrites.settle`). ``torch.nn.utils.prune``
applied to a parked parameter computes its mask from the stand-in: refused at the next step unless it
ran on gathered values (before wrapping, inside ``summon_full_params()``, or in ``model.apply(fn)`` on
the module being visited) or reads none (a mask given: ``prune.custom_from_mask``, ``prune.identity``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import cast

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod, CustomFromMask, Identity

from dtlab.core.torch_private import MODULE_HOOKS
from dtlab.core.traced import eager_when_traced
from dtlab.errors import StrategyError
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer
from dtlab.models.dp.flat import reshaped_error

__all__ = ["ParamWrites", "pre_hook_marks", "prune_hooks"]

_APPLY = "model.apply(fn)"


#: pruning methods whose mask reads no parameter values (a mask given; none): exact on a stand-in
_VALUE_FREE = (CustomFromMask, Identity)


def prune_hooks(module: nn.Module, recurse: bool = True) -> list[tuple[nn.Module, BasePruningMethod]]:
    """``(submodule, hook)`` of every ``torch.nn.utils.prune`` forward pre-hook in ``module`` (with
    ``recurse=False``: on ``module`` itself)."""
    pre = MODULE_HOOKS["register_forward_pre_hook"]
    modules = module.modules() if recurse else (module,)
    return [(m, h) for m in modules for h in pre(m).values() if isinstance(h, BasePruningMethod)]


def pre_hook_marks(modules: Sequence[nn.Module]) -> list[tuple[type, int, object]]:
    """What changes on each of ``modules`` when a forward pre-hook is added to it (as
    ``torch.nn.utils.prune`` adds one) or its class swapped (a first ``torch.nn.utils.parametrize``):
    its type, its pre-hook count and newest hook id (hook ids only grow); a fraction of a walk over
    the hooks themselves, for the checks made before every step."""
    pre = MODULE_HOOKS["register_forward_pre_hook"]
    return [(type(m), len(d := pre(m)), next(reversed(d), None)) for m in modules]


class ParamWrites:
    """Writes into the parameters of ``at_rest``'s units (``unit_of``: parameter id -> its unit)."""

    def __init__(self, at_rest: UnitGatherer, unit_of: Mapping[int, ShardUnit], module: nn.Module) -> None:
        self.at_rest = at_rest
        self.unit_of = unit_of
        self.module = module
        self._all: tuple[int, list[nn.Parameter]] | None = None  # (units, their parameters)
        #: torch.nn.utils.prune hooks whose mask came from whole values (by id; kept: ids are not reused)
        self._pruned: dict[int, BasePruningMethod] = {}
        #: the modules holding each unit's parameters (by unit id), whose prune hooks a write-back vets
        self._owners: dict[int, dict[int, nn.Module]] = {}
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if (st := unit_of.get(id(p))) is not None:
                    self._owners.setdefault(id(st), {})[id(m)] = m
        #: the modules holding a unit's parameters: only a prune hook on one of them reads a stand-in
        self._holders = list({id(m): m for owners in self._owners.values() for m in owners.values()}.values())
        self._vet_pruning([module])  # wrapping: every hook present saw whole values
        #: the holders' :func:`pre_hook_marks` when a check last found no prune hook left to vet
        self._clean: list[tuple[type, int, object]] | None = None

    def _prunings(self) -> list[tuple[nn.Module, BasePruningMethod]]:
        return [x for m in self._holders for x in prune_hooks(m, recurse=False)]

    def _vet_pruning(self, modules: list[nn.Module], recurse: bool = True) -> None:
        """The prune hooks on ``modules`` now computed their masks from whole values (wrapping, a gather
        of their units)."""
        self._pruned.update({id(h): h for m in modules for _, h in prune_hooks(m, recurse)})

    def _refuse_pruning(self, when: str) -> None:
        """Refuse ``torch.nn.utils.prune`` applied since wrapping to a parameter parked then (the mask
        computed from its stand-in); one applied to a parameter kept whole computed it from the values."""
        marks = pre_hook_marks(self._holders)
        if marks == self._clean:  # no hook added since a check that found none to vet
            return
        suspects = [
            m for m, h in self._prunings() if id(h) not in self._pruned and not isinstance(h, _VALUE_FREE)
        ]
        names = []
        for m in suspects:
            units = [
                self.unit_of.get(id(p)) for n, p in m.named_parameters(recurse=False) if n.endswith("_orig")
            ]
            if any(st is not None and not st.persistent for st in units):
                names += [n for n, x in self.module.named_modules() if x is m]
        if names:
            at = self.at_rest
            raise StrategyError(
                f"{at.who} on rank {at.group.rank}: {when} found torch.nn.utils.prune applied after wrapping "
                f"to {names[:5]} outside a gather: between uses each rank keeps 1/{at.group.world_size} of "
                "the parameters and a parameter is a stand-in of its shape, so the mask was computed from "
                "the stand-in, not from the values (not the mask torch computes). Prune the plain module "
                "before wrapping it, or on every rank inside with model.summon_full_params(): ... (the "
                "whole model gathered; prune.global_unstructured too); in model.apply(fn) prune only the "
                "module fn is given (its children's parameters are parked again by then)"
            )
        self._clean = None if suspects else marks

    def check(self, when: str, units: list[ShardUnit] | None = None) -> None:
        """Refuse writes into parked stand-ins of ``units`` (default: all) since they were parked: one
        read of their markers together (on an accelerator, one synchronization with the host); run
        eagerly inside a compiled forward (a read on the host, no graph of it)."""
        eager_when_traced(self._check)(when, units)

    def _check(self, when: str, units: list[ShardUnit] | None) -> None:
        if self.at_rest.busy:  # inside a forward or backward the units not gathered hold no stand-in
            return
        chosen = self.at_rest.units if units is None else units
        self._refuse_fills(when, [st for st in chosen if st.flat is None])
        ptrs = [x for st in chosen for x in st.unit.ptrs]
        if list(map(torch.Tensor.data_ptr, self._params(chosen))) != ptrs:  # one pass over all of them
            for st in chosen:
                if st.work is None and st.unit.ptrs != [p.data_ptr() for p in st.unit.params]:
                    self._adopt_replaced(st)

    def _refuse_fills(self, when: str, parked: list[ShardUnit]) -> None:
        if not parked:
            return
        marks = torch.cat([st.unit.marker for st in parked])
        if not bool(marks.isnan().logical_not_().any()):
            return
        names = []
        for st in parked:
            hit = st.unit.marker.isnan().logical_not_().tolist()
            names += [s.name for s, h in zip(st.unit.slots, hit, strict=True) if h]
            if any(hit):
                st.unit.park()  # a fresh stand-in: the values are the shard's, as before the write
        raise StrategyError(self._message(when, names))

    def _params(self, units: list[ShardUnit]) -> list[nn.Parameter]:
        """The parameters of ``units`` in order (all units' kept: this runs at every forward)."""
        if units is not self.at_rest.units:
            return [p for st in units for p in st.unit.params]
        if self._all is None or self._all[0] != len(units):  # units are only ever added
            self._all = (len(units), [p for st in units for p in st.unit.params])
        return self._all[1]

    def _adopt_replaced(self, st: ShardUnit) -> None:
        """``p.data = t`` (``torch.nn.utils.vector_to_parameters``, a model average written back) on a
        parameter of ``st`` since it was parked or gathered: the parameter no longer views the unit, and
        the next gather (or the optimizer's step of the shard) would drop ``t``. ``t``'s values become
        the parameter's, this rank's shard of them (every rank replaces it, as every rank writes under
        DDP), and the parameter views the unit again."""
        u = st.unit
        replaced = [
            (i, p) for i, (p, was) in enumerate(zip(u.params, u.ptrs, strict=True)) if p.data_ptr() != was
        ]
        if any(p.dtype != u.dtype or p.device != u.device for _, p in replaced):
            return  # converted (model.module.double()): WrappedAs refuses it, naming both dtypes
        wrong = [(i, p) for i, p in replaced if p.shape != u.slots[i].shape]
        if wrong:
            (i, p) = wrong[0]
            raise reshaped_error(self.at_rest.who, u.slots[i].name, p.shape, u.slots[i].shape)
        with torch.no_grad():
            if st.flat is None:  # parked: a whole buffer for this write only, this rank's shard kept
                # all NaN: a copy of the stand-in itself (model.module.double().float()), not a write
                replaced = [
                    (i, p) for i, p in replaced if not (u.dtype.is_floating_point and p.isnan().all())
                ]
                flat = u.new_flat()
                u.own_shard(flat).copy_(st.shard)
                views = u.views(flat)
                for i, p in replaced:
                    views[i].copy_(p.data)
                st.shard.copy_(u.own_shard(flat))
                u.park()  # fresh stand-ins (fills into the old marker were refused before)
            else:  # gathered (kept whole): its shard is refreshed from the buffer before it is read
                views = u.views(st.flat)
                for i, p in replaced:
                    views[i].copy_(p.data)
                u.bind(st.flat)

    def _message(self, when: str, names: list[str]) -> str:
        hint = (
            " (model.apply(fn) gathers for fn(m) the parameters m owns itself: for an fn writing into "
            "another module's parameters, call it inside with model.summon_full_params(): ...)"
            if when == _APPLY
            else ""
        )
        more = " ..." if len(names) > 5 else ""
        at = self.at_rest
        return (
            f"{at.who} on rank {at.group.rank}: {when} found parameters {names[:5]}{more} "
            f"({len(names)} in all) written in place while sharded, so the write was lost: between uses "
            f"each rank keeps 1/{at.group.world_size} of them and a parameter is a stand-in "
            "of its shape (model.module.apply(fn), p.fill_(), p.zero_() or p.data.zero_() write only "
            f"that). Write through the wrapper, on every rank: model.apply(fn){hint}, or inside "
            "with model.summon_full_params(): ...; or initialize before wrapping, or load values with "
            "model.load_state_dict(state). Other in-place writes on a stand-in (mul_, copy_, normal_) "
            "stop with torch's 'more than one element of the written-to tensor refers to a single "
            "memory location': the same fix"
        )

    def settle(self, when: str) -> None:
        """Before the optimizer or a checkpoint reads the shards: writes into stand-ins refused, the
        shards of the units kept gathered refreshed from their whole values (written or not)."""
        self.check(when)
        self._refuse_pruning(when)
        kept = [st for st in self.at_rest.units if st.persistent and st.flat is not None and st.work is None]
        if kept:  # one call for all (ZeRO-3 keeps every small parameter gathered: often most units)
            with torch.no_grad():
                torch._foreach_copy_(
                    [st.shard for st in kept], [st.unit.own_shard(cast(torch.Tensor, st.flat)) for st in kept]
                )

    def write_back(self, units: list[ShardUnit], persistent: Collection[int]) -> None:
        """Each rank keeps its shard of the gathered ``units``' values; those in ``persistent`` (ids),
        which stay gathered, are all-gathered again so every rank holds the same whole values (ids taken
        before ``keep_gathered()``, which marks every unit persistent while it runs)."""
        with torch.no_grad():
            for st in units:
                if st.flat is not None:
                    st.shard.copy_(st.unit.own_shard(st.flat))
                    if id(st) in persistent:
                        self.at_rest.group.all_gather(st.flat, st.shard)
        # the end of summon_full_params() or of a module in model.apply(fn): the prune hooks on the
        # modules of the units written back saw whole values (a hook elsewhere, e.g. put on a child by
        # fn(parent) after the child's units were freed, saw a stand-in: still refused at the step)
        owners = {
            id(m): m for st in units if st.flat is not None for m in self._owners.get(id(st), {}).values()
        }
        self._vet_pruning(list(owners.values()), recurse=False)

    def apply(self, module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        """``nn.Module.apply(fn)`` over ``module``: ``fn(m)`` for every submodule, children first, with
        the units holding ``m``'s own parameters gathered (at most one module's units at a time, kept
        across modules that share them: an FSDP unit is gathered once for its members), then written
        back. The gathers depend on the module tree only, so every rank runs the same collectives."""
        held: list[ShardUnit] = []

        def visit(m: nn.Module) -> None:
            own = (self.unit_of.get(id(p)) for p in m.parameters(recurse=False))
            self._hold(held, list({id(st): st for st in own if st is not None}.values()))
            fn(m)

        try:
            module.apply(visit)  # torch's order: children first
        except BaseException:
            for st in held:  # nothing written back after an error (a collective other ranks may skip)
                self.at_rest.free(st)
            raise
        self._hold(held, [])
        self.check(_APPLY)

    def _hold(self, held: list[ShardUnit], need: list[ShardUnit]) -> None:
        """Write back and free the ``held`` units not in ``need``, gather those of ``need`` not held."""
        keep, have = {id(st) for st in need}, {id(st) for st in held}
        done = [st for st in held if id(st) not in keep]
        self.write_back(done, {id(st) for st in done if st.persistent})
        for st in done:
            self.at_rest.free(st)
        new = [st for st in need if id(st) not in have]
        self.check(_APPLY, new)  # a write into one since it was parked would be dropped by the gather
        for st in new:
            self.at_rest.gather(st)
        held[:] = need
