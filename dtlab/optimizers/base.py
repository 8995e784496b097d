"""What every optimizer strategy offers (docs/architecture.md, section "Optimizer strategies")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from dtlab.backends.base import ReduceOp
from dtlab.core.state import ShardedState
from dtlab.models.base import ModelStrategy

__all__ = ["OptimizerStrategy", "WrappingStrategy"]


class OptimizerStrategy(torch.optim.Optimizer, ABC):
    """Wraps a model strategy and the user's torch optimizer: ``ZeRO1Optimizer(model, AdamW, lr=...)``
    or ``ZeRO1Optimizer(model, torch.optim.AdamW(groups, lr=...))``.

    It is a ``torch.optim.Optimizer`` (``param_groups``, ``state``, ``state_dict()``,
    ``load_state_dict()``, ``add_param_group()``, ``zero_grad()``), so torch's LR schedulers attach
    to it. It owns which rank holds which optimizer state, ``step()``, reshardable state, the global
    gradient norm (correct under sharded gradients) and consensus helpers.
    """

    strategy_name: ClassVar[str] = "base"
    #: model strategy names this optimizer strategy accepts; a mismatch is an error at construction
    compatible_models: ClassVar[tuple[str, ...]] = ()

    model: ModelStrategy

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The local torch optimizer (over this rank's pieces); its groups follow this one's."""

    @abstractmethod
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        ...

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @abstractmethod
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip by the global norm of the model's (synchronized) gradients; returns that norm. A data-
        parallel strategy sums shards over ``model.dp_backend`` (each data-parallel group holds one
        whole model); strategies that split parameters over other axes add those axes. torch's
        ``clip_grad_norm_`` arguments: ``error_if_nonfinite`` raises torch's RuntimeError on every rank
        when the global norm is NaN or infinite; ``foreach`` is accepted and changes nothing."""

    @abstractmethod
    def grads_are_finite(self) -> bool:
        """True on every rank iff every rank's synchronized gradients are finite: a consensus over
        ``model.world_backend`` (see :meth:`agree`)."""

    @abstractmethod
    def sharded_state_dict(self) -> ShardedState: ...

    @abstractmethod
    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None: ...

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds, counted from the state's tensors."""
        total = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def memory_report(self) -> dict[str, int]:
        """The model's memory report with ``optimizer_state`` filled in."""
        report = dict(self.model.memory_report())
        report["optimizer_state"] = self.state_bytes()
        return report

    def agree(self, flag: bool) -> bool:
        """Consensus: True on every rank iff ``flag`` is True on every rank (early stopping etc.).

        Spans ``model.world_backend`` (every rank of a mesh, not only this data-parallel group), so
        all ranks take the same branch."""
        world = self.model.world_backend
        t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=world.device)
        world.all_reduce(t, ReduceOp.MAX)
        return int(t.item()) == 0


class WrappingStrategy(OptimizerStrategy):
    """An optimizer strategy around another one (compression, elastic): torch's optimizer surface
    (param groups, state, state dicts), the step, the gradients' norm and the checkpoints are the inner
    strategy's, and so is any attribute the wrapper lacks; :meth:`own_memory` adds to its report."""

    inner: OptimizerStrategy
    #: the wrapper's own attributes, never read from the inner strategy (unset while ``__init__`` runs)
    own_attributes: ClassVar[tuple[str, ...]] = ("inner", "model")

    def __getattr__(self, name: str) -> Any:  # only reached for attributes the wrapper lacks
        if name in self.own_attributes:
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.inner.optimizer

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        return self.inner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def grads_are_finite(self) -> bool:
        return self.inner.grads_are_finite()

    def state_bytes(self) -> int:
        return self.inner.state_bytes()

    def own_memory(self) -> dict[str, int]:
        """Bytes the wrapper itself holds, by kind (added to the inner strategy's memory report)."""
        return {}

    def memory_report(self) -> dict[str, int]:
        return {**self.inner.memory_report(), **self.own_memory()}

    def sharded_state_dict(self) -> ShardedState:
        return self.inner.sharded_state_dict()

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        self.inner.load_sharded_state_dict(shards)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.inner.defaults = defaults

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)
