"""FSDP: parameters sharded per wrapped unit, one flat parameter per unit (FSDP1's FlatParameter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models.dp._grad_guard import watch_plain_steps
from dtlab.models.dp._sharded import ShardedModel, ShardedOptions, UnitPlan

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FSDPModel", "ModuleClassPolicy", "SizePolicy", "WrapPolicy"]


@dataclass(frozen=True)
class ModuleClassPolicy:
    """Wrap every module that is an instance of one of ``classes`` (e.g. the transformer block)."""

    classes: tuple[type[nn.Module], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.classes, tuple) or not self.classes:
            raise ValueError(f"ModuleClassPolicy.classes must be a non-empty tuple, got {self.classes!r}")
        bad = [c for c in self.classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"ModuleClassPolicy.classes must be nn.Module subclasses, got {bad}")

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:  # noqa: ARG002 - the WrapPolicy interface
        return isinstance(module, self.classes)


@dataclass(frozen=True)
class SizePolicy:
    """Wrap a module once its parameters not already in an inner unit reach ``min_num_params``.

    An ``nn.ModuleList`` or ``nn.ModuleDict`` is never a unit (as torch's size policy): it runs no
    forward of its own, so its parameters count towards the module that runs its members.
    """

    min_num_params: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_num_params, int) or self.min_num_params < 1:
            raise ValueError(f"SizePolicy.min_num_params must be an int >= 1, got {self.min_num_params!r}")

    def should_wrap(self, module: nn.Module, unwrapped_params: int) -> bool:
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            return False
        return unwrapped_params >= self.min_num_params


WrapPolicy = ModuleClassPolicy | SizePolicy


class FSDPModel(ShardedModel):
    """Fully sharded data parallelism: a wrap policy picks the unit modules (like FSDP2's per-module
    ``fully_shard``); the root module is always a unit and takes the parameters no inner unit claims.
    Each unit's trainable parameters are one flat buffer, this rank keeps ``1/P`` of it; the unit is
    gathered around its forward and its backward. Frozen parameters are kept whole on every rank.

    Args:
        module, backend: as for DDPModel.
        wrap_policy: which submodules become units (``None``: the whole module is one unit).
        reshard_after_forward: as FSDP2's. ``None`` (default): every unit but the root is freed after
            its forward; the root (the wrapped module's own unit, whose forward spans the whole forward)
            stays gathered for its backward, which begins by gathering it: one all-gather of the root
            fewer per step at the same peak of gathered parameters (held while the loss is computed:
            where that is the step's peak, a large vocabulary, it rises by the root's bytes). ``True``:
            every unit freed after its forward, the root too (FSDP2's ``fully_shard(model,
            reshard_after_forward=True)``: the root not held while the loss is computed, one more
            all-gather). ``False``: every unit kept gathered until its
            backward (ZeRO-2-like, one all-gather per unit per step, the whole model gathered at the
            peak). A forward without gradients (``torch.no_grad()``, evaluation) frees every unit, the
            root too; a forward whose backward never comes holds the root alone, until a backward or the
            optimizer's ``zero_grad()`` frees it (the next forward reuses it).
        prefetch: all-gather the next unit while the current one computes.
        reduce_dtype, find_unused_parameters, broadcast_buffers, world: as for DDPModel.
        init_seed, param_init_fn, forward_wait_s: as for ZeRO3Model.
    """

    strategy_name: ClassVar[str] = "fsdp"

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        *,
        wrap_policy: WrapPolicy | None = None,
        reshard_after_forward: bool | None = None,
        **options: Unpack[ShardedOptions],
    ) -> None:
        if wrap_policy is not None and not isinstance(wrap_policy, ModuleClassPolicy | SizePolicy):
            raise TypeError(
                "wrap_policy must be a ModuleClassPolicy, a SizePolicy or None, got "
                f"{type(wrap_policy).__name__}"
            )
        self.wrap_policy = wrap_policy
        watch_plain_steps()
        super().__init__(module, backend, reshard_after_forward=reshard_after_forward, **options)

    def _unit_modules(self) -> set[int]:
        wrapped: set[int] = set()

        def visit(mod: nn.Module) -> int:
            """Post-order: returns the trainable parameters under ``mod`` not in an inner unit."""
            count = sum(p.numel() for p in mod.parameters(recurse=False) if id(p) in self._name_of)
            for child in mod.children():
                count += visit(child)
            if (
                self.wrap_policy is not None
                and mod is not self.module
                and self.wrap_policy.should_wrap(mod, count)
            ):
                wrapped.add(id(mod))
                return 0
            return count

        visit(self.module)
        wrapped.add(id(self.module))
        return wrapped

    def _plan(self) -> list[tuple[nn.Module, list[UnitPlan]]]:
        names = self._name_of
        units = self._unit_modules()

        def collect(mod: nn.Module) -> list[nn.Parameter]:
            """``mod``'s trainable parameters and those of its children not in an inner unit."""
            own = [p for p in mod.parameters(recurse=False) if id(p) in names]
            return own + [p for child in mod.children() if id(child) not in units for p in collect(child)]

        owner: dict[int, str] = {}
        plan = []
        for mname, mod in self.module.named_modules():
            if id(mod) not in units:
                continue
            uname = mname or "<root>"
            params = list({id(p): p for p in collect(mod)}.values())  # a parameter used twice: once
            for p in params:
                if owner.setdefault(id(p), uname) != uname:
                    raise StrategyError(
                        f"FSDPModel: parameter {names[id(p)]!r} is shared by units {owner[id(p)]!r} and "
                        f"{uname!r}; a tied parameter must live in one unit: change the wrap policy so one "
                        "unit contains both users"
                    )
            plan.append((mod, [UnitPlan(uname, [(names[id(p)], p) for p in params])] if params else []))
        return plan
