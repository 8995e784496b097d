"""Stand-ins for ``param.grad`` where a rank holds only part of the synchronized gradient.

After a synchronized backward, ZeRO-1 (reduce-scatter), ZeRO-2, ZeRO-3 and FSDP keep each rank's
shard of the averaged gradient inside the strategy, where torch's ``clip_grad_norm_`` or a plain torch
optimizer reading ``param.grad`` would be silently wrong. ``param.grad`` is then a
:class:`ShardedGradient` of the parameter's shape, dtype and device (``p.grad is not None`` and shape
checks work) holding no memory, which refuses every operation naming the dtlab call that does it
right. The model's next forward (or ``zero_grad()``) removes it. Every stand-in (the composition's too)
refuses torch ``GradScaler``'s unscale, naming ``dtlab.optimizers.GradScaler``. Zeroing a
:class:`ShardedGradient` (``module.zero_grad(set_to_none=False)``, a plain optimizer's ``zero_grad``)
only marks it ``zeroed``: the strategy then drops the gradient it stands for, as torch would
(:func:`adopt_cleared`). A plain torch optimizer stepped over parked ZeRO-3/FSDP parameters is refused
before it writes (:func:`refuse_plain_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from dtlab.core.torch_private import global_optimizer_step_pre_hooks
from dtlab.errors import StrategyError

__all__ = [
    "GradientStandIn",
    "ShardedGradient",
    "adopt_cleared",
    "refuse_plain_step",
    "sharded_grad_message",
    "tensor_bytes",
    "watch_plain_steps",
]


_AMP_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_
_ZERO = (torch.ops.aten.zero_, torch.ops.aten._foreach_zero_)
_AMP_MESSAGE = (
    "torch.amp.GradScaler checks param.grad on this rank only, which here is part of the gradient (a "
    "shard, a tensor-parallel piece or one pipeline stage's): an overflow elsewhere would go unseen, "
    "ranks would step or skip apart and their loss scales drift. Use dtlab.optimizers.GradScaler, torch's "
    "calls with every rank agreeing: scaler = GradScaler(init_scale=...); scaler.scale(loss).backward(); "
    "scaler.unscale_(opt); opt.clip_grad_norm_(max_norm); scaler.step(opt); scaler.update()"
)


class GradientStandIn(torch.Tensor):
    """A ``param.grad`` stand-in of the parameter's shape, dtype and device. Without ``piece`` it holds no
    memory and refuses every operation; with one, every operation runs on ``piece`` but those in
    ``refused`` (torch ops' overload packets). A refusal raises a StrategyError with ``message``, which
    names the fix."""

    piece: torch.Tensor | None
    message: str
    refused: frozenset[Any]
    zeroed: bool  #: a ShardedGradient zeroed (see there)
    __torch_function__: ClassVar[Any] = torch._C._disabled_torch_function_impl  # noqa: SLF001 - torch's API for a wrapper tensor subclass

    @staticmethod
    def __new__(
        cls,
        like: torch.Tensor,
        message: str,
        piece: torch.Tensor | None = None,
        refused: frozenset[Any] = frozenset(),
    ) -> GradientStandIn:
        made = torch.Tensor._make_wrapper_subclass(  # noqa: SLF001 - torch's API for a wrapper tensor subclass
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        out: GradientStandIn = made
        out.piece, out.message, out.refused, out.zeroed = piece, message, refused, False
        return out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func.overloadpacket is _AMP_UNSCALE:  # torch.amp.GradScaler: a check of this rank's part only
            raise StrategyError(_AMP_MESSAGE)
        if func.overloadpacket in _ZERO:  # zero_grad(set_to_none=False): the gradient is to be dropped
            found = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            if all(isinstance(t, ShardedGradient) for t in found):
                for t in found:
                    t.zeroed = True
                return None if isinstance(args[0], list | tuple) else args[0]

        def unwrap(a: Any) -> Any:
            if isinstance(a, GradientStandIn):
                if a.piece is None or func.overloadpacket in a.refused:
                    raise StrategyError(a.message)
                return a.piece
            return a

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        held = f"shape={tuple(self.shape)}, dtype={self.dtype}" if self.piece is None else repr(self.piece)
        return f"{type(self).__name__}({held}: {self.message})"


class ShardedGradient(GradientStandIn):
    """Where a rank holds only a shard of the synchronized gradient: refuses every operation but
    zeroing, which sets ``zeroed`` (see the module docstring)."""


def sharded_grad_message(name: str, model: str, optimizer: str) -> str:
    """The refusal of parameter ``name``'s stand-in under ``model``, stepped by ``optimizer``."""
    return (
        f"param.grad of {name!r} is not the whole gradient on this rank under {model}: after the "
        "synchronized backward each rank keeps only its shard of the averaged gradient, inside the "
        "strategy. torch.nn.utils.clip_grad_norm_ / clip_grad_value_ or a plain torch optimizer would "
        "see a partial gradient (a wrong norm, a step that changes nothing), so dtlab refuses. Clip "
        "with opt.clip_grad_norm_(max_norm) or opt.clip_grad_value_(value) (the global norm across "
        f"ranks) and step with the optimizer strategy: opt = {optimizer}(model, "
        "torch.optim.AdamW(model.parameters(), lr=...)) (it takes your torch optimizer and its param "
        "groups). A backward pass whose forward did not run before it through the model strategy "
        "(the wrapped module called directly) reaches this too: call the wrapper, or opt.zero_grad() "
        "after opt.step(); so does a second backward over one forward (after backward(retain_graph=True)): "
        "add the losses and call backward() once per forward"
    )


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes ``t`` holds (a :class:`ShardedGradient` stand-in none; a sparse gradient its rows, indices)."""
    if t is not None and t.is_sparse:
        return tensor_bytes(t._values()) + tensor_bytes(t._indices())  # noqa: SLF001 - torch's sparse API
    return 0 if t is None or isinstance(t, ShardedGradient) else t.numel() * t.element_size()


def adopt_cleared(
    guarded: bool, who: str, trainable: Sequence[tuple[str, nn.Parameter]], zero_all: Callable[[bool], None]
) -> None:
    """While ``guarded`` (the stand-ins are in place): ``zero_all(set_to_none)`` when every stand-in of
    ``trainable`` was set to None or zeroed since the synchronized backward (``set_to_none``: some were
    set to None); refuse (``who``: the strategy) when only some were.

    torch's ways of clearing gradients (``model.zero_grad()``, ``model.module.zero_grad()``, ``p.grad =
    None``, zeroing) touch only ``param.grad``: left there, the shards would keep the last step's
    gradient and the next backward would add into it, so this runs before the next forward or step."""
    if not guarded:
        return
    cleared = [
        n for n, p in trainable if p.grad is None or (isinstance(p.grad, ShardedGradient) and p.grad.zeroed)
    ]
    if not cleared:
        return
    if len(cleared) == len(trainable):
        zero_all(any(p.grad is None for _, p in trainable))
        return
    kept = len(trainable) - len(cleared)
    raise StrategyError(
        f"{who}: the gradients of {cleared[:5]}{' ...' if len(cleared) > 5 else ''} ({len(cleared)} "
        f"parameters) were cleared (param.grad set to None or zeroed) after the synchronized backward, "
        f"those of the other {kept} were not. Each rank holds its shard of every averaged gradient in "
        "flat buffers shared by many parameters, so one parameter's gradient cannot be dropped alone. "
        "Clear them all with opt.zero_grad() or model.zero_grad(); to keep a parameter from training, "
        "freeze it (requires_grad=False) before wrapping"
    )


def watch_plain_steps() -> None:
    """Register :func:`refuse_plain_step` as torch's global step pre-hook, once per process, when it builds
    its first ZeRO-3/FSDP model (a process that builds none pays nothing at its steps; a second
    registration, two rank threads racing here, only runs the check twice)."""
    if refuse_plain_step not in global_optimizer_step_pre_hooks():
        register_optimizer_step_pre_hook(refuse_plain_step)


def refuse_plain_step(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Raise if ``opt``, a plain torch optimizer, holds a parked ZeRO-3/FSDP parameter (a stand-in of its
    shape over one element, every stride 0). Its gradient's stand-in refuses a plain optimizer too, but
    AdamW's decoupled weight decay (``param.mul_(1 - lr * wd)``) writes into the parameter before it
    reads the gradient: torch then stops with its overlap ``RuntimeError`` ("Please clone() the
    tensor"), whose advice does not apply. Reads each parameter's strides only (no memory, no sync)."""
    if hasattr(opt, "strategy_name") and hasattr(opt, "state_bytes"):  # an optimizer strategy
        return
    name = type(opt).__name__
    cls = f"torch.optim.{name}" if getattr(torch.optim, name, None) is type(opt) else name  # or the user's
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if p.numel() > 1 and not any(p.stride()):
                raise StrategyError(
                    f"{name}.step(): parameter {i} of param group {g} (shape {tuple(p.shape)}) "
                    "is sharded (ZeRO3Model, FSDPModel, or a mesh's zero3/fsdp): each rank holds only a "
                    "shard of it and of its gradient, inside the strategy, so a plain torch optimizer would "
                    "step a stand-in, not the parameter. Step with the optimizer strategy: "
                    f"opt = ZeRO3Optimizer(model, {cls}(model.parameters(), ...)) (it takes your torch "
                    "optimizer and its param groups), and clip with opt.clip_grad_norm_(max_norm)"
                )
