"""What the DDP and ZeRO optimizer strategies share: construction checks, the global gradient norm,
the finite-gradient consensus and the reshardable optimizer-state format (see dtlab.models.state)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import ReduceOp
from dtlab.core import pairs
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError, StrategyError
from dtlab.models.base import ModelStrategy, OptimizerTarget
from dtlab.models.state import (
    ShardIndex,
    add_placed_slice,
    add_scalar,
    dtype_from_str,
    new_state,
    read_placed,
)
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.untrusted import summary

__all__ = ["DataParallelOptimizer", "Piece"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of parameter ``name`` lie at ``offset`` of an optimizer tensor."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    offset: int


class DataParallelOptimizer(OptimizerStrategy):
    """Base of DDPOptimizer and the ZeRO optimizers: one local torch optimizer over ``_tensors``."""

    strategy_name: ClassVar[str] = "dp"

    def __init__(
        self, model: ModelStrategy, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> None:
        me = type(self).__name__
        if not isinstance(model, OptimizerTarget):
            fitting = ", ".join(map(pairs.model_class_name, self.compatible_models))
            raise StrategyError(
                f"{me} drives a dtlab model strategy ({fitting}), got "
                f"{type(model).__name__}; wrap the module first, e.g. {me}({self._model_hint()}(module, "
                "backend), torch.optim.AdamW, lr=...)"
            )
        if model.strategy_name not in self.compatible_models:
            fix = (
                pairs.optimizer_class_name(pairs.default_optimizer(model.strategy_name))
                if model.strategy_name in pairs.PAIRINGS
                else "the matching optimizer strategy"
            )
            raise StrategyError(
                f"{me} cannot drive a {type(model).__name__} (strategy {model.strategy_name!r}); it works "
                f"with {', '.join(map(pairs.model_class_name, self.compatible_models))}. Use {fix} with "
                f"{type(model).__name__}, or wrap the module in {self._model_hint()} to use {me}"
            )
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"{me} takes a torch.optim.Optimizer class (e.g. torch.optim.AdamW) and its keyword "
                f"arguments, got {optimizer_cls!r}"
            )
        if "params" in kwargs:
            raise TypeError(f"{me} picks the parameters itself from the model; do not pass params=")
        self.model = model
        self._tensors, self._pieces, self._names = self._build()
        self._opt = optimizer_cls(self._tensors, **kwargs)
        model.attach_optimizer(self)

    def _model_hint(self) -> str:
        return pairs.model_class_name(self.compatible_models[0]) if self.compatible_models else "DDPModel"

    def _build(self) -> tuple[list[torch.Tensor], list[list[Piece]], list[list[str]]]:
        """The tensors the torch optimizer steps, the parameter pieces each holds (saved by this
        rank) and the parameter names each touches (for scalar state such as ``step``)."""
        raise NotImplementedError

    @property
    def dp_model(self) -> OptimizerTarget:
        model = self.model
        if not isinstance(model, OptimizerTarget):
            raise StrategyError("the model is not a data-parallel model strategy")  # checked at construction
        return model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._opt

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - torch.optim.Optimizer's signature; the buffers keep their memory either way
        """Zero the synchronized gradients (bucket buffers and shards keep their memory)."""
        self.dp_model.zero_grad_buffers()

    # ------------------------------------------------------------------ norms and consensus
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if not (isinstance(max_norm, int | float) and max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        model = self.dp_model
        tensors, replicated = model.norm_grad_tensors()
        device = model.dp_backend.device
        if math.isinf(norm_type):
            local = max((t.detach().abs().max().double() for t in tensors if t.numel()), default=None)
            total = torch.zeros(1, dtype=torch.float64, device=device) if local is None else local.reshape(1)
            if not replicated:
                model.grad_norm_group().all_reduce(total, ReduceOp.MAX)
            norm = total[0]
        else:
            acc = torch.zeros(1, dtype=torch.float64, device=device)
            for t in tensors:
                if t.numel():
                    acc += t.detach().double().abs().pow(norm_type).sum()
            if not replicated:
                model.grad_norm_group().all_reduce(acc, ReduceOp.SUM)
            norm = acc[0].pow(1.0 / norm_type)
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            model.scale_grads_(coef)
        return norm.float()

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every synchronized gradient to ``[-clip_value, clip_value]`` (torch's
        ``clip_grad_value_`` on the gradients as this strategy holds them: whole or this rank's shard)."""
        if not (isinstance(clip_value, int | float) and clip_value > 0):
            raise ValueError(f"clip_value must be a number > 0, got {clip_value!r}")
        tensors, _ = self.dp_model.norm_grad_tensors()
        with torch.no_grad():
            for t in tensors:
                t.clamp_(-float(clip_value), float(clip_value))

    def grads_are_finite(self) -> bool:
        tensors, _ = self.dp_model.norm_grad_tensors()
        local = all(bool(torch.isfinite(t).all()) for t in tensors)
        return self.agree(local)

    # ------------------------------------------------------------------ state
    def sharded_state_dict(self) -> ShardedState:
        backend = self.dp_model.dp_backend
        state = new_state(self.strategy_name, backend.world_size, backend.rank)
        keys: set[str] = set()
        for t, pieces, names in zip(self._tensors, self._pieces, self._names, strict=True):
            for sk, v in self._opt.state.get(t, {}).items():
                keys.add(sk)
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != t.shape:
                        raise StrategyError(
                            f"{type(self).__name__}: optimizer state {sk!r} has shape {tuple(v.shape)}, not "
                            f"the parameter's {tuple(t.shape)}; only element-wise optimizer state "
                            "(SGD, Adam, AdamW, RMSprop, ...) can be sharded and resharded"
                        )
                    flat = v.reshape(-1)
                    for pc in pieces:
                        add_placed_slice(
                            state,
                            f"{pc.name}.{sk}",
                            pc.shape,
                            *self.dp_model.placed(pc.name),
                            v.dtype,
                            pc.start,
                            pc.end,
                            flat[pc.offset : pc.offset + pc.end - pc.start],
                        )
                else:
                    for name in names:
                        add_scalar(state, f"{name}.{sk}", v)
        state.metadata["state_keys"] = sorted(keys)
        state.metadata["param_groups"] = [_jsonable(g) for g in self._opt.param_groups]
        return state

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        index = ShardIndex(shards)
        keys = index.extra.get("state_keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CheckpointError(
                f"optimizer shard metadata: state_keys={summary(keys)}, expected a list of names"
            )
        saved = index.extra.get("param_groups")
        _check_groups(saved, self._opt.param_groups)
        for t, pieces, names in zip(self._tensors, self._needed_pieces(), self._names, strict=True):
            st: dict[str, Any] = {}
            for sk in keys:
                tensor_keys = [f"{pc.name}.{sk}" for pc in pieces]
                if tensor_keys and all(k in index for k in tensor_keys):
                    buf = torch.zeros(t.numel(), dtype=dtype_from_str(index.meta[tensor_keys[0]][1]))
                    for pc in pieces:
                        buf[pc.offset : pc.offset + pc.end - pc.start] = read_placed(
                            index,
                            f"{pc.name}.{sk}",
                            pc.shape,
                            *self.dp_model.placed(pc.name),
                            pc.start,
                            pc.end,
                        )
                    st[sk] = buf.reshape(t.shape).to(t.device)
                    continue
                scalar = next(
                    (index.scalars[f"{n}.{sk}"] for n in names if f"{n}.{sk}" in index.scalars), None
                )
                if scalar is not None:
                    st[sk] = (
                        torch.tensor(scalar["value"], dtype=dtype_from_str(scalar["dtype"]))
                        if scalar["dtype"] is not None
                        else scalar["value"]
                    )
                elif any(f"{n}.{sk}" in index for n in names):
                    st[sk] = torch.zeros_like(t)  # this tensor holds only padding of that state
            if st:
                self._opt.state[t] = st
        if saved and len(saved) == len(self._opt.param_groups):
            for group, values in zip(self._opt.param_groups, saved, strict=True):
                for k, v in values.items():
                    if k in group and k != "params":
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v

    def _needed_pieces(self) -> list[list[Piece]]:
        """The pieces each optimizer tensor must be filled with on load (default: what it saves)."""
        return self._pieces


def _same_kind(saved: Any, live: Any) -> bool:
    if isinstance(live, torch.Tensor):
        live = 0.0  # saved as its value (see _jsonable)
    if isinstance(live, bool) or live is None:
        return isinstance(saved, bool) or saved is None
    if isinstance(live, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(live, list | tuple):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_same_kind, saved, live))
    return isinstance(saved, type(live))


def _check_groups(saved: Any, groups: list[dict[str, Any]]) -> None:
    """Saved param-group hyperparameters must be of the kind the live groups hold (a number where a
    number is): a :class:`CheckpointError` naming the value otherwise, before anything is set."""
    if saved is None:
        return
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(
            f"optimizer shard metadata: param_groups={summary(saved)}, expected a list of objects"
        )
    if len(saved) != len(groups):
        return  # another grouping: the saved hyperparameters are not applied (see below)
    for i, (values, group) in enumerate(zip(saved, groups, strict=True)):
        for k, v in values.items():
            if k in group and k != "params" and not _same_kind(v, group[k]):
                raise CheckpointError(
                    f"optimizer shard metadata: param_groups[{i}].{k}={summary(v)}, but the optimizer "
                    f"holds {summary(group[k])} there"
                )


def _jsonable(group: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else None
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, bool | int | float | str | list):
            out[k] = v
    return out
