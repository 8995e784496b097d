"""Meta-device construction for ZeRO-3 and FSDP (each rank materializes only its own shards), and the
pieces the model-parallel composition's meta walk shares; what it does for the user: docs/big_models.md.

:class:`MetaInit` first gives each meta parameter a one-element placeholder on the backend's device
(the wrapper plans its units from shapes, dtypes and devices; no value is read), then, once the units
exist with zeroed shards, initializes one module's own tensors at a time, whole on the CPU, in
registration order under ``seeded_init(init_seed)`` and keeps this rank's slice. A tied parameter is
initialized by its first module; a later module's draw goes into a throwaway tensor (as the plain
build drew values the tie then discarded).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypedDict, cast

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from dtlab.core.rng import model_building, seeded_init
from dtlab.core.torch_private import tensor_version
from dtlab.errors import ArgumentError, StrategyError, integer
from dtlab.models.dp._hf_init import HFInit
from dtlab.models.dp._sharded_units import ShardUnit
from dtlab.models.dp.flat import Slot

__all__ = [
    "MetaInit",
    "MetaOptions",
    "MetaFill",
    "OwnTensor",
    "ParamInitFn",
    "init_empty_weights",
    "on_meta",
    "own_tensors",
]

ParamInitFn = Callable[[nn.Module], None]
OwnTensor = tuple[str, torch.Tensor, bool]  #: (own name in its module, the tensor, is a parameter)


class MetaOptions(TypedDict, total=False):
    """How a module built on the meta device is initialized (``init_seed``, ``param_init_fn``: see
    :class:`~dtlab.models.ZeRO3Model` and :class:`~dtlab.models.HybridShardedModel`)."""

    init_seed: int | None
    param_init_fn: ParamInitFn | None


@contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules inside the block with their *parameters* on the meta device and everything else
    real (buffers computed in ``__init__`` keep their values; docs/big_models.md). Each parameter is
    moved to meta as it is registered. Only modules built by the thread that entered the block are
    affected (in-memory ranks are threads), and the block runs alone among model builds of the process
    (the hook is process-wide state of torch's), so build the model inside it and wrap it after it::

        with dtlab.models.init_empty_weights():
            net = MyModel()
        model = FSDPModel(net, backend, init_seed=0)
    """
    owner = threading.get_ident()

    def to_meta(_module: nn.Module, _name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta or threading.get_ident() != owner:
            return None
        empty = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        empty.__dict__.update(param.__dict__)
        return empty

    with model_building():  # torch types the hook as returning None; it may return a parameter
        handle = register_module_parameter_registration_hook(cast(Callable[..., None], to_meta))
        try:
            yield
        finally:
            handle.remove()


def on_meta(
    module: nn.Module,
    init_seed: int | None,
    param_init_fn: ParamInitFn | None,
    who: str,
    part: str,
    misuse: type[ArgumentError] | type[StrategyError] = StrategyError,
) -> int | None:
    """``init_seed`` when ``module`` was built on the meta device (every parameter on meta), ``None``
    when no parameter is: ``who``'s checks of a meta build, raised with the value and the fix (``part``:
    what each rank initializes; ``misuse``: the error class of init arguments given to a module not on
    meta)."""
    if init_seed is not None and integer(init_seed) is None:
        raise ArgumentError(f"{who}: init_seed must be an int, got {init_seed!r}")
    if param_init_fn is not None and not callable(param_init_fn):
        raise ArgumentError(f"{who}: param_init_fn must be a callable taking a module, got {param_init_fn!r}")
    named = list(module.named_parameters())
    meta = [n for n, p in named if p.is_meta]
    if not meta:
        if init_seed is not None or param_init_fn is not None:
            raise misuse(
                f"{who}: init_seed/param_init_fn initialize a module built on the meta device, but the "
                f"parameters of {type(module).__name__} are already on "
                f"{named[0][1].device if named else '-'}; build it under `with torch.device('meta'):` "
                "or drop init_seed/param_init_fn"
            )
        return None
    if len(meta) < len(named):
        real = [n for n, p in named if not p.is_meta]
        raise StrategyError(
            f"{who}: some parameters are on the meta device ({meta[:3]}) and some are not ({real[:3]}); "
            "build the whole module under `with torch.device('meta'):` (its parameters all on meta)"
        )
    if init_seed is None:
        raise StrategyError(
            f"{who}: the parameters of {type(module).__name__} are on the meta device ({meta[:3]}); "
            f"pass init_seed=<int> so each rank materializes and initializes only {part} (the values "
            "equal the model built plainly under dtlab.core.seeded_init(init_seed), then wrapped)"
        )
    return int(init_seed)


def own_tensors(mod: nn.Module) -> list[OwnTensor]:
    """``mod``'s own parameters, then its own buffers on the meta device: what a meta build fills."""
    own: list[OwnTensor] = [(n, p, True) for n, p in mod.named_parameters(recurse=False)]
    return own + [(n, b, False) for n, b in mod.named_buffers(recurse=False) if b.is_meta]


def _sentinel(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor on the CPU filled with the value that marks it as not initialized yet."""
    t = torch.empty(shape, dtype=dtype, device="cpu")
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


def _untouched(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds the sentinel somewhere (floats: any NaN; integers: all the minimum).
    Floats are checked through their sum first (a scalar), so the check allocates no tensor of ``t``'s
    size unless the sum is NaN."""
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t.sum())) and bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False  # no value is a sentinel for a bool: whether it was written is checked instead
    return bool((t == torch.iinfo(t.dtype).min).all())


@dataclass
class MetaFill:
    """How a model built on the meta device fills a module's own tensors: ``who`` names the model in
    errors, ``root`` is the whole model as built (a Hugging Face root brings ``_init_weights``)."""

    who: str
    root: nn.Module
    param_init_fn: ParamInitFn | None

    def __post_init__(self) -> None:
        self.hf = HFInit.of(self.root) if self.param_init_fn is None else None

    def initializer(self, mname: str, mod: nn.Module, tname: str) -> ParamInitFn:
        """What fills ``mod``'s own tensors (``tname``: the first of them): ``param_init_fn``; else, in a
        Hugging Face model (a root with ``_init_weights`` and a ``config``), the model's
        ``_init_weights(mod)``, then its ancestors' (:class:`HFInit`); else its ``reset_parameters()``;
        else an error naming the tensor."""
        if self.param_init_fn is not None:
            return self.param_init_fn
        if self.hf is not None:
            return self.hf
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            return lambda m: reset()  # noqa: ARG005 - the ParamInitFn form
        path = tname if mname == "<root>" else f"{mname}.{tname}"
        raise StrategyError(
            f"{self.who}: {path!r} of module {mname!r} ({type(mod).__name__}) is on the meta "
            f"device and nothing initializes it: {type(mod).__name__} has no reset_parameters(); pass "
            "param_init_fn=fn (fn(module) fills the module's own parameters and buffers in place), or "
            "build the module with its buffers on the real device (parameters only on meta)"
        )

    def init_checked(
        self,
        mname: str,
        mod: nn.Module,
        own: list[OwnTensor],
        done: set[int],
        shapes: Mapping[int, torch.Size],
    ) -> list[tuple[OwnTensor, torch.Tensor]]:
        """Run :meth:`initializer` on ``mod`` with its ``own`` tensors (non-empty) replaced by whole CPU
        tensors holding the :func:`_sentinel` (a parameter's shape from ``shapes`` by id where given),
        then restore them. Returns each tensor with the value it got, except parameters in ``done``
        (tied, initialized by an earlier module: this draw is dropped); the others join ``done``. A
        value still holding the sentinel is refused, naming the tensor and the fix."""
        init = self.initializer(mname, mod, own[0][0])
        saved = [(n, getattr(mod, n)) for n, _, _ in own]
        flags: dict[str, tuple[torch.Tensor, int]] = {}  # bool tensors: no value marks them, their writes do
        for n, t, is_param in own:
            whole = _sentinel(shapes.get(id(t), t.shape), t.dtype)
            setattr(mod, n, nn.Parameter(whole, requires_grad=t.requires_grad) if is_param else whole)
            if whole.dtype == torch.bool:
                flags[n] = (getattr(mod, n), tensor_version(whole))
        try:
            init(mod)
            values = [getattr(mod, n).detach() for n, _, _ in own]
            unwritten = {n for n, (t, v) in flags.items() if getattr(mod, n) is t and tensor_version(t) == v}
        finally:
            for n, old in saved:
                setattr(mod, n, old)
        fresh: list[tuple[OwnTensor, torch.Tensor]] = []
        for (n, t, is_param), value in zip(own, values, strict=True):
            if is_param and id(t) in done:
                continue
            if _untouched(value) or n in unwritten:
                how = "param_init_fn" if self.param_init_fn is not None else "its initialization"
                raise StrategyError(
                    f"{self.who}: {'parameter' if is_param else 'buffer'} {n!r} of module {mname!r} "
                    f"({type(mod).__name__}) was built on the meta device and {how} left it (partly) "
                    "uninitialized; pass param_init_fn=fn that fills it in place, or build the module with "
                    "its buffers on the real device (parameters only on meta)"
                )
            if is_param:
                done.add(id(t))
            fresh.append(((n, t, is_param), value))
        return fresh


@dataclass
class MetaInit:
    """The meta-device parameters and buffers of one module, and how to initialize them."""

    fill: MetaFill
    seed: int
    device: torch.device
    shapes: dict[int, torch.Size]  #: by parameter id: the wrapper empties the parameters it shards

    @staticmethod
    def prepare(
        module: nn.Module,
        device: torch.device,
        init_seed: int | None,
        param_init_fn: ParamInitFn | None,
        who: str,
    ) -> MetaInit | None:
        """``None`` when no parameter is on meta; else give each meta parameter a one-element
        placeholder on ``device`` (shape kept) and move buffers not on meta to ``device``."""
        seed = on_meta(module, init_seed, param_init_fn, who, "its shards", ArgumentError)
        if seed is None:
            return None
        with torch.no_grad():
            swapped: dict[int, nn.Parameter] = {}  # a meta tensor's data cannot be set: new objects
            for mod in module.modules():
                for pname, p in list(mod.named_parameters(recurse=False)):
                    if id(p) not in swapped:
                        hold = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
                        swapped[id(p)] = nn.Parameter(hold, requires_grad=p.requires_grad)
                        swapped[id(p)].__dict__.update(p.__dict__)  # e.g. a tensor-parallel placement
                    setattr(mod, pname, swapped[id(p)])
                for bname, b in list(mod.named_buffers(recurse=False)):
                    if not b.is_meta and b.device != device:
                        setattr(mod, bname, b.to(device))
        shapes = {id(q): q.shape for q in swapped.values()}
        return MetaInit(MetaFill(who, module, param_init_fn), seed, device, shapes)

    def materialize(self, units: list[ShardUnit]) -> None:
        """Initialize every module's own tensors in registration order and keep this rank's part:
        shards of sharded units, the whole buffer of persistent units, frozen parameters and meta
        buffers whole (on the device)."""
        places = {
            id(q): (st, slot) for st in units for slot, q in zip(st.unit.slots, st.unit.params, strict=True)
        }
        done: set[int] = set()
        with torch.no_grad(), seeded_init(self.seed):
            for mname, mod in self.fill.root.named_modules(remove_duplicate=True):
                self._init_module(mname or "<root>", mod, places, done)
        for st in units:
            if st.flat is not None:  # persistent: its shard is the slice of the whole buffer
                st.shard.copy_(st.unit.own_shard(st.flat))

    def _init_module(
        self, mname: str, mod: nn.Module, places: dict[int, tuple[ShardUnit, Slot]], done: set[int]
    ) -> None:
        own = own_tensors(mod)
        if not own:
            return
        for (name, t, is_param), value in self.fill.init_checked(mname, mod, own, done, self.shapes):
            place = places.get(id(t))
            if not is_param:
                setattr(mod, name, value.to(self.device))
            elif place is None:  # frozen: kept whole on every rank
                t.data = value.to(self.device)
            else:  # the unit's binding stays (a view of its whole buffer, or empty)
                self._place(value.reshape(-1), place)

    @staticmethod
    def _place(flat: torch.Tensor, place: tuple[ShardUnit, Slot]) -> None:
        st, slot = place
        if st.flat is not None:
            st.flat[slot.offset : slot.offset + slot.numel].copy_(flat)
            return
        for s, a, b, at in st.unit.shard_slots():
            if s is slot:
                st.shard[at : at + b - a].copy_(flat[a:b])
