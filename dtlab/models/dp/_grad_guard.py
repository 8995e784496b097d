"""Stand-ins for ``param.grad`` where a rank holds only part of the synchronized gradient.

After a synchronized backward, ZeRO-1 (reduce-scatter), ZeRO-2, ZeRO-3 and FSDP keep each rank's
shard of the averaged gradient inside the strategy, where torch's ``clip_grad_norm_`` or a plain torch
optimizer reading ``param.grad`` would be silently wrong. ``param.grad`` is then a
:class:`ShardedGradient` of the parameter's shape, dtype and device (``p.grad is not None`` and shape
checks work) holding no memory, which refuses every operation naming the dtlab call that does it
right. The model's next forward (or ``zero_grad()``) removes it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from dtlab.errors import StrategyError

__all__ = ["ShardedGradient", "sharded_grad_message", "tensor_bytes"]


class ShardedGradient(torch.Tensor):
    """A ``param.grad`` that refuses every operation, naming the fix (see the module docstring)."""

    message: str
    __torch_function__: ClassVar[Any] = torch._C._disabled_torch_function_impl  # noqa: SLF001 - torch's API for a tensor subclass holding no storage

    @staticmethod
    def __new__(cls, like: torch.Tensor, message: str) -> ShardedGradient:
        made = torch.Tensor._make_wrapper_subclass(  # noqa: SLF001 - torch's API for a tensor subclass holding no storage
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        out: ShardedGradient = made
        out.message = message
        return out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        leaves = tree_flatten((args, kwargs))[0]
        found = next((a for a in leaves if isinstance(a, ShardedGradient)), None)
        raise StrategyError(found.message if found is not None else "a sharded gradient was read")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}: {self.message})"


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
    """Bytes ``t`` holds (a :class:`ShardedGradient` stand-in holds none)."""
    return 0 if t is None or isinstance(t, ShardedGradient) else t.numel() * t.element_size()
