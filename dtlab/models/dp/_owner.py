"""Which modules a data-parallel wrapper takes (:func:`check_module`), and which wrapper owns a module's
parameters, and over whose group its ``nn.SyncBatchNorm`` layers synchronize: the newest one, as torch
users expect.

Each parameter carries a weak reference to the :class:`Ownership` of the wrapper that hooked it. A new
wrapper of the same parameters takes them over: the old wrapper's gradient hooks are removed (so each
gradient is reduced once, by the new wrapper) and the old wrapper refuses further use. A wrapper that
keeps the parameters as flat shards (ZeRO-3, FSDP) cannot hand them over (each rank holds only its
shard), so wrapping its module again is refused. Trainable parameters added to the module after
wrapping are refused at the next step (:meth:`Ownership.check_added`).
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import TYPE_CHECKING, Any

from torch import nn

from dtlab.backends.base import CommunicationBackend, check_backend
from dtlab.core.torch_private import TENSOR_HOOKS
from dtlab.errors import ArgumentTypeError, StrategyError, check_switches
from dtlab.models.dp._sync_bn import DataParallelBatchNorm, sync_batch_norms
from dtlab.models.dp.flat import check_real

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = [
    "Ownership",
    "check_module",
    "check_sharded_options",
    "check_types",
    "rewrap_advice",
    "torch_option_refused",
]

#: the attribute of a parameter holding the :class:`_Mark` of the wrapper that hooked it
_MARK = "_dtlab_owner"

_HOOKS = TENSOR_HOOKS["register_post_accumulate_grad_hook"]


class _Mark:
    """A weak reference to an :class:`Ownership`; pickled (``torch.save(module)``) as a mark to nobody."""

    __slots__ = ("_ref",)

    def __init__(self, owner: Ownership | None = None) -> None:
        self._ref = None if owner is None else weakref.ref(owner)

    def __reduce__(self) -> tuple[type[_Mark], tuple[()]]:
        return (_Mark, ())

    def owner(self) -> Ownership | None:
        return None if self._ref is None else self._ref()


class Ownership:
    """The claim of the wrapper ``who`` (over ``group``) on ``module``'s parameters and the hooks it put
    on them; its SyncBatchNorm layers are refused here if dtlab cannot synchronize them as asked."""

    def __init__(self, who: str, module: nn.Module, group: CommunicationBackend, keeps_shards: bool) -> None:
        self.who = who
        self.keeps_shards = keeps_shards
        self._module = module
        self._params = {id(p): p for p in module.parameters()}
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._group = group
        self._batch_norms = sync_batch_norms(module, who)
        self._handles: list[RemovableHandle] = []
        #: the ids of the hooks this wrapper put on its parameters
        self.hook_ids: set[int] = set()
        #: the class name of the wrapper that took the parameters over (None: still the owner)
        self.replaced_by: str | None = None

    def owns(self, param: nn.Parameter) -> bool:
        return self.replaced_by is None and self._params.get(id(param)) is param

    def _previous(self) -> list[Ownership]:
        """The live wrappers owning any of these parameters (a copied marker is not ownership)."""
        found: dict[int, Ownership] = {}
        for p in self._params.values():
            mark = getattr(p, _MARK, None)
            old = mark.owner() if isinstance(mark, _Mark) else None
            if old is not None and old is not self and old.owns(p):
                found[id(old)] = old
        return list(found.values())

    def check_free(self) -> None:
        """Refuse (before the new wrapper changes anything) parameters another wrapper keeps sharded, and
        post-accumulate-grad hooks of the user's (see :meth:`check`)."""
        self._refuse_foreign_hooks("to wrap the module", {i for o in self._previous() for i in o.hook_ids})
        for old in self._previous():
            if old.keeps_shards:
                raise StrategyError(
                    f"{self.who}: the module is already wrapped by a {old.who}, which keeps its parameters "
                    "as flat shards (each rank holds only its part), so it cannot be wrapped again. Build "
                    f"the new wrapper from a fresh module, or call full_state_dict() on the {old.who} (every "
                    "rank) and load it into a fresh module (module.load_state_dict(state)) to wrap that"
                )

    def claim(self) -> None:
        """Take the parameters over (after :meth:`check_free`, which the wrapper calls before any change):
        every previous owner's hooks are removed and it refuses use; SyncBatchNorm syncs over our group."""
        for old in self._previous():
            old.give_up(self.who)
        for bn in self._batch_norms:
            vars(bn)["forward"] = DataParallelBatchNorm(bn, self._group)
        mark = _Mark(self)
        for p in self._params.values():
            setattr(p, _MARK, mark)

    def keep(self, handle: RemovableHandle) -> None:
        """A hook this wrapper put on its parameters, removed when a newer wrapper takes them over."""
        self._handles.append(handle)
        self.hook_ids.add(handle.id)

    def give_up(self, by: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.hook_ids, self.replaced_by = [], set(), by

    def check(self, what: str) -> None:
        """Refuse ``what`` (forward, step, ...) once a newer wrapper owns the parameters."""
        if self.replaced_by is not None:
            raise StrategyError(
                f"{self.who}: this wrapper was replaced by a newer wrapper of the same module (a "
                f"{self.replaced_by} took its parameters over, and it alone reduces their gradients now), "
                f"so it refuses {what}; use the new one (and an optimizer built on it)"
            )
        self._refuse_foreign_hooks(what, self.hook_ids)

    def check_added(self) -> None:
        """Refuse, naming them, trainable parameters of the module that were not there at wrapping. Such a
        parameter (a LoRA adapter put around a layer of ``model.module``, a new head, a parametrization's
        ``original``) has none of the strategy's hooks, buckets or shards: its gradient would never be
        averaged and the optimizer strategy never steps it."""
        ids = self._params
        if all(id(p) in ids or not p.requires_grad for p in self._module.parameters()):
            return
        added = [n for n, p in self._module.named_parameters() if p.requires_grad and id(p) not in ids]
        fresh = (
            "; the wrapped module holds shards, so load the wrapper's full_state_dict() (every rank) into a "
            "fresh plain module, add them there and wrap that"
            if self.keeps_shards
            else ", or build a new wrapper and optimizer strategy on the module after adding them"
        )
        raise StrategyError(
            f"{self.who}: trainable parameters were added to the module after wrapping it: {added[:5]}"
            f"{' ...' if len(added) > 5 else ''} ({len(added)} in all; a LoRA adapter or a new layer put "
            "into model.module, or a parametrization registered after wrapping). The strategy averages and "
            "steps the parameters the module had when it was wrapped, so these would train on each rank's "
            f"own gradient or not at all. Add them to the plain module before wrapping it (freeze the base "
            f"weights there too){fresh}"
        )

    def _refuse_foreign_hooks(self, what: str, ours: set[int]) -> None:
        """Refuse a post-accumulate-grad hook on a trainable parameter that is not this wrapper's: it
        would see this rank's gradient before the average (or, under the sharding strategies, after the
        strategy took it into its shards), so "optimizer in backward" would step each rank apart.

        It runs at every forward and step: first one pass in C over every hook id on the parameters
        (none foreign: done), then, only when some hook is not ours, the per-parameter search."""
        if ours.issuperset(chain.from_iterable(filter(None, map(_HOOKS, self._params.values())))):
            return
        for key, p in self._params.items():
            hooks = _HOOKS(p)
            if p.requires_grad and hooks and not hooks.keys() <= ours:
                raise StrategyError(
                    f"{self.who} refuses {what}: parameter {self._names[key]!r} has a hook of yours from "
                    "register_post_accumulate_grad_hook. It would run on this rank's own gradient before "
                    "the strategy averages it over the ranks (or find it already taken into the "
                    "strategy's shards), so an optimizer step in it ('optimizer in backward') would move "
                    "each rank's copy its own way. Remove it (handle.remove()) and step after backward "
                    "with the optimizer strategy, opt.step() (the reduction already overlaps the "
                    "backward); to watch or change a gradient use p.register_hook(fn): it sees this "
                    "rank's gradient before the reduction and what it returns is what gets averaged"
                )


def check_types(module: object, backend: object, who: str) -> None:
    """Refuses what the data-parallel wrapper ``who`` was given, before anything reads it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} wraps a torch.nn.Module, got {type(module).__name__}")
    check_backend(backend, who)


def check_sharded_options(forward_wait_s: object, reshard_after_forward: object, **switches: object) -> None:
    """Refuses a ZeRO-3/FSDP ``forward_wait_s`` that is not seconds >= 0, a ``reshard_after_forward``
    that is not True, False or None and ``switches`` that are not bools (``'no'`` would be taken as true)."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ArgumentTypeError(
            "reshard_after_forward must be True, False or None (every unit but the root resharded), got "
            f"{reshard_after_forward!r}"
        )
    if isinstance(forward_wait_s, bool) or not (
        isinstance(forward_wait_s, int | float) and forward_wait_s >= 0
    ):
        raise ValueError(
            f"forward_wait_s must be a number of seconds >= 0 (0: no limit), got {forward_wait_s!r}"
        )
    check_switches(**switches)


def check_module(
    module: nn.Module, backend: CommunicationBackend, who: str
) -> list[tuple[str, nn.Parameter]]:
    """``module``'s trainable parameters; refuses a module the data-parallel wrapper ``who`` cannot take."""
    named = list(module.named_parameters())
    if not named:
        raise StrategyError(
            f"{who}: the module {type(module).__name__} has no parameters, so there is nothing to train "
            "or synchronize; wrap a module that has parameters"
        )
    devices: dict[str, list[str]] = {}
    for n, p in named:
        devices.setdefault(str(p.device), []).append(n)
    if len(devices) > 1:
        listing = "; ".join(f"{d}: {names[:3]}" for d, names in devices.items())
        raise StrategyError(
            f"{who}: parameters are on mixed devices ({listing}); move the whole module to one device "
            f"with module.to({str(backend.device)!r}) before wrapping it"
        )
    device = named[0][1].device
    if device.type == "meta":
        raise StrategyError(
            f"{who}: the parameters of {type(module).__name__} are on the meta device; {who} keeps the "
            "whole model on every rank, so build the module plainly (under dtlab.core.seeded_init(seed)), "
            "or wrap it in ZeRO3Model/FSDPModel with init_seed=<int> (each rank initializes its shards; "
            "TensorParallelModel, PipelineParallelModel and HybridShardedModel take init_seed too)"
        )
    if device.type != backend.device.type:
        raise StrategyError(
            f"{who}: parameters are on {device} but the backend {backend.name} works on {backend.device}; "
            f"call module.to({str(backend.device)!r}) before wrapping it"
        )
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if backend.world_size > 1:
        check_real(who, trainable)
    if not trainable:
        raise StrategyError(
            f"{who}: every parameter of {type(module).__name__} has requires_grad=False; there are no "
            "gradients to synchronize (unfreeze some parameters or do not wrap the module)"
        )
    return trainable


def rewrap_advice(shards_at_rest: bool) -> str:
    """How to change which parameters train once a module is wrapped (and keep the optimizer state)."""
    keep = (
        "; to keep the optimizer state (torch's opt.add_param_group for a newly unfrozen group): "
        "sd = opt.state_dict(), a new optimizer strategy on the new wrapper over the parameters trained "
        "before, opt.load_state_dict(sd), then opt.add_param_group({'params': unfrozen})"
    )
    if shards_at_rest:  # its parameters are flat shards: a new wrapper needs a whole module
        return (
            "to change which parameters train, load full_state_dict() (every rank) into a fresh "
            "module, set requires_grad there and wrap that" + keep
        )
    return "rebuild the wrapper after changing which parameters train" + keep


#: what the refusal of a second optimizer strategy on one model says
SWITCH_ADVICE = (
    "build one optimizer strategy per model (param groups give parts of it their own options; two "
    "torch optimizer classes on one model: docs/porting.md). To switch optimizers mid-run (torch: a new "
    "optimizer on the same parameters, Adam to SGD), wrap again and build the new optimizer strategy on "
    "the new wrapper: under DDP and ZeRO-1/2 wrap model.module; under ZeRO-3, FSDP, tensor and pipeline "
    "parallelism a fresh module loaded with model.state_dict() (every rank)"
)


_MOVE = "move the module to this rank's device before wrapping it (module.to(backend.device))"

#: torch DDP's and FSDP2's constructor options: what to do instead (None: no other value is taken), and
#: the values that ask for what the strategy does anyway (torch's defaults; a layout or tracing hint,
#: which changes no result), taken so that a ported call need not drop them
_TORCH_OPTIONS: dict[str, tuple[str | None, tuple[Any, ...]]] = {
    "device_ids": (_MOVE, (None,)),
    "output_device": (_MOVE, (None,)),
    "process_group": ("pass the group as the backend argument (on a mesh: mesh['dp'])", (None,)),
    "mesh": ("pass the group as the backend argument; for 2-D sharding use HybridShardedModel", (None,)),
    "mp_policy": (
        "keep float32 parameters, compute under torch.autocast (reduce_dtype=: the reduction)",
        (None,),
    ),
    "init_sync": ("drop it: the module is broadcast from rank 0 when wrapped", (True,)),
    "static_graph": (None, (False, True)),
    "gradient_as_bucket_view": (None, (False, True)),
}


def torch_option_refused(who: str, options: dict[str, Any]) -> ArgumentTypeError | None:
    """The error for constructor options ``who`` does not take, naming torch's counterparts' fix; None
    where each is one of torch's that asks for what ``who`` does anyway (``device_ids=None``,
    ``static_graph=True``)."""
    known = {k: _TORCH_OPTIONS.get(k, (None, ())) for k in options}
    refused = [k for k, v in options.items() if not any(v is x for x in known[k][1])]
    if not refused:
        return None
    name, fix = refused[0], known[refused[0]][0]
    said = f"torch's {name}= has no counterpart here: {fix}" if fix else f"{name}= is not one of its options"
    return ArgumentTypeError(f"{who}({name}=...): {said} (its options: docs/strategies.md, help({who}))")
