"""ZeRO-3: every parameter sharded on its own, gathered on demand around the module that uses it."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import ArgumentError, integer
from dtlab.models.dp._grad_guard import watch_plain_steps
from dtlab.models.dp._sharded import ShardedModel, ShardedOptions, UnitPlan

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ZeRO3Model"]


class ZeRO3Model(ShardedModel):
    """Per-parameter sharding (DeepSpeed ZeRO stage 3): each trainable parameter is one flat unit, this
    rank keeps ``1/P`` of it; the parameters a module owns directly are gathered around its forward and
    its backward. Parameters under ``persistence_threshold`` and parameters shared by several modules
    (tied weights) stay gathered, still updated as shards (reduce-scatter, step, all-gather).

    Args:
        module, backend: as for DDPModel.
        persistence_threshold: parameters with at most this many elements are kept whole
            (default 100_000, DeepSpeed's ``stage3_param_persistence_threshold``); 0 shards everything.
            The config's ``strategy.persistence_threshold`` defaults to 0 instead: its embedded models
            are small, and under 100_000 nothing in them would be sharded.
        leaf_modules: module classes gathered as one piece with their children (their forward reads
            their children's parameters: ``nn.MultiheadAttention`` reads ``out_proj.weight``).
        prefetch: all-gather the next module's parameters while the current one computes.
        reduce_dtype, find_unused_parameters, broadcast_buffers: as for DDPModel.
        init_seed: for a module built on the meta device (``with torch.device("meta"):``): each rank
            materializes only its shards and initializes them, one module at a time, with the module's
            ``reset_parameters()`` (or ``param_init_fn``) under ``dtlab.core.seeded_init(init_seed)``:
            bitwise the values of the module built plainly under ``seeded_init(init_seed)`` when its
            layers draw in ``reset_parameters()`` in registration order (``torch.nn`` layers). Keep
            buffers on the real device (parameters only on meta); a tensor nothing initializes is an error.
        param_init_fn: ``fn(module)`` filling the module's own (``recurse=False``) parameters and meta
            buffers in place, called instead of ``reset_parameters()`` for every module that has any.
        forward_wait_s: an evaluation (no-grad) forward that the other ranks do not join within this
            many seconds stops with an error naming the cause (every rank must call forward under a
            sharded strategy) instead of hanging for the collective timeout; 0: wait as long as it takes.
    """

    strategy_name: ClassVar[str] = "zero3"

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        persistence_threshold: int = 100_000,
        leaf_modules: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,),
        **options: Unpack[ShardedOptions],
    ) -> None:
        given: dict[str, object] = dict(options)
        if "reshard_after_forward" in given:  # FSDP's option, not one of ZeRO-3's
            raise ArgumentError(
                f"ZeRO3Model: reshard_after_forward={given['reshard_after_forward']!r} is FSDPModel's "
                "option; ZeRO-3 frees each module's parameters after its forward and gathers them "
                "again for its backward (DeepSpeed's stage 3). To keep them gathered until the backward "
                "use FSDPModel(module, backend, reshard_after_forward=False) (more memory, one "
                "all-gather fewer per step), with ZeRO3Optimizer as for ZeRO-3"
            )
        if integer(persistence_threshold) is None or persistence_threshold < 0:
            raise ValueError(f"persistence_threshold must be an int >= 0, got {persistence_threshold!r}")
        if not isinstance(leaf_modules, tuple | list):
            raise TypeError(
                f"leaf_modules must be a tuple of nn.Module subclasses, got {leaf_modules!r}; e.g. "
                "(nn.MultiheadAttention,)"
            )
        bad = [c for c in leaf_modules if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"leaf_modules must be nn.Module subclasses, got {bad}")
        self.persistence_threshold = persistence_threshold
        watch_plain_steps()
        self.leaf_modules = tuple(leaf_modules)
        super().__init__(module, backend, reshard_after_forward=True, **options)
        if backend.world_size > 1 and all(st.persistent for st in self._units):
            warnings.warn(_nothing_sharded(persistence_threshold, self._trainable), UserWarning, stacklevel=2)

    def _plan(self) -> list[tuple[nn.Module, list[UnitPlan]]]:
        names = self._name_of
        inside_leaf: set[int] = set()
        owned: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for mod in self.module.modules():
            if id(mod) in inside_leaf:
                continue
            leaf = isinstance(mod, self.leaf_modules)
            if leaf:
                inside_leaf.update(id(m) for m in mod.modules())
            owned.append((mod, [p for p in mod.parameters(recurse=leaf) if id(p) in names]))
        users = Counter(id(p) for _, params in owned for p in params)
        plan, done = [], set()
        for mod, params in owned:
            units = []
            for p in params:
                if id(p) not in done:
                    done.add(id(p))
                    keep = p.numel() <= self.persistence_threshold or users[id(p)] > 1
                    units.append(UnitPlan(names[id(p)], [(names[id(p)], p)], persistent=keep))
            plan.append((mod, units))
        return plan


def _nothing_sharded(threshold: int, trainable: list[tuple[str, nn.Parameter]]) -> str:
    """Why every parameter stayed whole, and what to change: the threshold, or tied parameters (a
    parameter used by several modules is kept whole on every rank)."""
    above = [n for n, p in trainable if p.numel() > threshold]
    if not above:
        return (
            f"ZeRO3Model: persistence_threshold={threshold} keeps every parameter whole on every rank, so "
            "nothing is sharded and ZeRO-3 saves no parameter memory; pass persistence_threshold=0 (or "
            f"below {max(p.numel() for _, p in trainable)}, the largest parameter's size) to shard them"
        )
    return (
        f"ZeRO3Model: every parameter above persistence_threshold={threshold} ({', '.join(above[:4])}"
        f"{', ...' if len(above) > 4 else ''}) is used by more than one module (tied weights), and ZeRO-3 "
        "keeps such parameters whole on every rank, so nothing is sharded and ZeRO-3 saves no parameter "
        "memory; use FSDPModel with a wrap policy whose unit holds every module using them (or ZeRO-3's "
        "leaf_modules naming a module that holds them all), or untie the weights"
    )
