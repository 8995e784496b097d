"""torch DDP's and FSDP2's methods on dtlab's wrappers: FSDP2's gradient-sync switch works as there
(``set_requires_gradient_sync``, the same as DDP's ``require_backward_grad_sync``); the other methods a
ported script calls are refused by name, with what dtlab does instead, rather than with a bare
``AttributeError``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

__all__ = ["ForwardedSync", "TorchMethods"]

_SUMMON = (
    "under ZeRO-3 and FSDP, `with model.summon_full_params():` gathers the whole model for a block (every "
    "rank); a forward gathers each unit itself; under DDP, ZeRO-1/2 and on a tensor-parallel model the "
    "parameters are this rank's to read already"
)

#: torch's method -> what dtlab does instead
_FIXES: dict[str, str] = {
    "unshard": _SUMMON,
    "reshard": _SUMMON,
    "set_is_last_backward": "each backward outside no_sync() reduces the gradients; nothing to set",
    "set_requires_all_reduce": "dtlab has one data-parallel axis (no HSDP replicas); use no_sync() or "
    "set_requires_gradient_sync(False) to skip the reduction",
    "set_reshard_after_backward": "parameters are freed after their backward; not configurable",
    "set_reshard_after_forward": "pass reshard_after_forward= when wrapping: FSDPModel(module, backend, "
    "reshard_after_forward=False)",
    "set_modules_to_forward_prefetch": "ZeRO-3/FSDP prefetch the next unit themselves (prefetch=True, "
    "an option when wrapping)",
    "set_modules_to_backward_prefetch": "ZeRO-3/FSDP prefetch the next unit themselves (prefetch=True, "
    "an option when wrapping)",
    "set_gradient_divide_factor": "gradients are averaged over the data-parallel ranks as torch's; for "
    "another factor scale the loss",
    "register_comm_hook": "compress the gradient reduction with dtlab.optimizers.GradientCompressionOptimizer"
    "(opt, compressor) (docs/compression.md), or narrow it with reduce_dtype= when wrapping",
    "_set_static_graph": "nothing is traced, static_graph is taken as given; nothing to set",
}


class SyncSwitch(Protocol):
    require_backward_grad_sync: bool


class TorchMethods(nn.Module):
    """The torch methods of a data-parallel wrapper (see the module docstring)."""

    require_backward_grad_sync: bool  # each wrapper's own switch (a property there)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: ``False``: backward passes accumulate gradients locally, as inside
        ``no_sync()``; ``True``: the next backward reduces them. ``recurse`` is accepted (one switch
        decides for the whole model)."""
        for what, value in (("requires_gradient_sync", requires_gradient_sync), ("recurse", recurse)):
            if not isinstance(value, bool):
                raise TypeError(f"{what} must be a bool, got {value!r}")
        self.require_backward_grad_sync = requires_gradient_sync

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError as exc:
            fix = _FIXES.get(name)
            if fix is None:
                raise
            raise AttributeError(
                f"{type(self).__name__} has no {name!r} (a method of torch's DDP or FSDP2): {fix}"
            ) from exc


class ForwardedSync(TorchMethods):
    """A composition's gradient-sync switch: its data-parallel strategy's (``dp_strategy``)."""

    if TYPE_CHECKING:  # the composition's property

        @property
        def dp_strategy(self) -> SyncSwitch: ...

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's switch: ``False``: backward passes accumulate locally (as in ``no_sync()``)."""
        return self.dp_strategy.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.dp_strategy.require_backward_grad_sync = value
