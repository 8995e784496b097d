"""What every model strategy offers (docs/architecture.md, section "Model strategies"):
:class:`ModelStrategy`, and :class:`OptimizerTarget`, the part an optimizer strategy drives."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, SupportsIndex

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Placement
from dtlab.core.reducer import GradientReducer
from dtlab.core.shard_index import add_slice, new_state
from dtlab.core.state import ShardedState
from dtlab.errors import (
    ArgumentError,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    StrategyError,
    every_rank_saves,
)
from dtlab.models.placed_state import given_state
from dtlab.models.step_args import batch_pair
from dtlab.models.wrapped_as import WrappedAs, conversion_refused

if TYPE_CHECKING:
    from dtlab.models.dp.flat import FlatUnit

__all__ = [
    "AttachedOptimizer",
    "ModelStrategy",
    "OptimizerTarget",
    "WrappedAs",
    "conversion_refused",
    "copy_refused",
]


class AttachedOptimizer(Protocol):
    """What a model strategy reads of the optimizer strategy that drives it (models sit below
    optimizers: they know this much of it and nothing else)."""

    @property
    def strategy_name(self) -> str:
        """The optimizer strategy's name in the pairing table (``"ddp"``, ``"zero1"``, ...)."""
        ...

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        ...


def _check_world(
    world: CommunicationBackend | None, backend: CommunicationBackend, who: str
) -> CommunicationBackend | None:
    if world is None:
        return None
    if not isinstance(world, CommunicationBackend):
        raise TypeError(
            f"{who}: world must be a dtlab CommunicationBackend or None, got {type(world).__name__}"
        )
    if world.world_size < backend.world_size or world.world_size % backend.world_size:
        raise ArgumentError(
            f"{who}: world has {world.world_size} ranks but the data-parallel group has "
            f"{backend.world_size}; world must be the wider group this one lives in (e.g. "
            "DDPModel(module, mesh['dp'], world=mesh.backend)), its size a multiple of the group's"
        )
    if world.device.type != backend.device.type:
        raise ArgumentError(
            f"{who}: world works on {world.device} but the data-parallel group on {backend.device}; "
            "build both on the same engine"
        )
    return world


def copy_refused(who: str, rank: int, module_copies: bool) -> StrategyError:
    """The error for a copy or a pickle (``copy.deepcopy``, ``AveragedModel(model)``, timm's
    ``ModelEmaV2``, ``torch.save(model)``) of the wrapper ``who`` or of a module whose hooks belong to
    it: the copy would share or duplicate rank ``rank``'s backend and the hooks feeding it.
    ``module_copies``: ``model.module`` holds the whole parameters and no hook (DDP, ZeRO-1/2)."""
    if module_copies:
        fix = (
            "copy the plain module instead: AveragedModel(model.module) or copy.deepcopy(model.module) "
            "(whole parameters, the same on every rank, no hook of the wrapper); save with "
            "torch.save(model.state_dict())"
        )
    else:
        fix = (
            "its module holds only this rank's part of the parameters, so average the whole weights: "
            "ema = model.state_dict() on every rank, then after each step ema[k].lerp_(v, 1 - decay) for "
            "k, v in model.state_dict().items(); or this rank's piece, model.sharded_state_dict() "
            "(docs/porting.md, 'EMA / SWA / copying a wrapped model')"
        )
    return StrategyError(
        f"{who} cannot be copied or pickled{'' if module_copies else ', nor its module'} (copy.deepcopy, "
        "torch.optim.swa_utils.AveragedModel(model), timm's ModelEmaV2, torch.save(model)): the copy "
        f"would share or duplicate rank {rank}'s communication backend and the hooks feeding it; {fix}"
    )


class ModelStrategy(nn.Module):
    """An ``nn.Module`` wrapping ``module`` (forward works) that owns where its parameters and
    gradients live and sends gradients through its :attr:`gradient_reducer`."""

    #: short name used in configs, checkpoints and errors ("ddp", "zero1", ...)
    strategy_name: ClassVar[str] = "base"

    def __init__(
        self, module: nn.Module, backend: CommunicationBackend, *, world: CommunicationBackend | None = None
    ) -> None:
        super().__init__()
        self.module = module
        #: the group the strategy was built on (for a data-parallel strategy: its data-parallel group);
        #: code outside the strategy asks for :attr:`dp_backend` or :attr:`world_backend` instead
        self.backend = backend
        self._world = _check_world(world, backend, type(self).__name__)
        #: refuses ``model.module.double()`` / ``.to()`` at the next use (checked by the subclasses)
        self._wrapped_as = WrappedAs(type(self).__name__, module)

    @property
    @abstractmethod
    def gradient_reducer(self) -> GradientReducer:
        """The reducer all gradients go through; assign a new one to change how they travel."""

    @gradient_reducer.setter
    @abstractmethod
    def gradient_reducer(self, reducer: GradientReducer) -> None: ...

    @property
    def dp_backend(self) -> CommunicationBackend:
        """The data-parallel group: gradients are averaged over it, the data sampler splits the global
        batch by its rank and size, the trainer averages the loss over it (the whole backend for pure
        data parallelism)."""
        return self.backend

    @property
    def world_backend(self) -> CommunicationBackend:
        """Every rank that must take the same decision: the finite-gradient check, ``agree()``, early
        stopping and the non-finite guard span it, so all ranks of a mesh skip a step together.
        The ``world=`` given at construction (on a mesh: ``mesh.backend``), else :attr:`dp_backend`."""
        return self._world if self._world is not None else self.dp_backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _check_as_outer(self, inner: ModelStrategy) -> None:
        """Share the dtype/device check of ``inner``, which wraps the same module (a composition's
        data-parallel strategy), named as this class: one snapshot, one check per forward."""
        self._wrapped_as = inner._wrapped_as
        self._wrapped_as.who = type(self).__name__

    #: whether ``module`` holds the whole parameters and no hook of the strategy (DDP, ZeRO-1/2): a
    #: copy of it is a plain model
    module_copies: ClassVar[bool] = False

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``model.double()``, ``.half()``, ``.to(...)``, ``.cuda()``: refused, before anything changes,
        if ``fn`` changes a parameter's dtype or device (probed on an empty tensor of each parameter's
        dtype and device); a conversion that changes no parameter (``model.float()`` on a float32
        model, ``model.to("cpu")`` on CPU, a buffer's dtype alone) runs as on a plain module."""
        probed: set[tuple[torch.dtype, torch.device]] = set()
        for name, p in self.module.named_parameters():
            if (p.dtype, p.device) not in probed:
                probed.add((p.dtype, p.device))
                was = torch.empty(0, dtype=p.dtype, device=p.device)
                now = fn(was)
                if now.dtype != was.dtype or now.device != was.device:
                    raise conversion_refused(type(self).__name__, name, was, now, "refused converting")
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Copying or pickling the wrapper is refused, naming what to copy instead (:func:`copy_refused`)."""
        raise copy_refused(type(self).__name__, self.world_backend.rank, self.module_copies)

    def join(self, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: ARG002 - torch DDP's signature
        """torch DDP's ``join()`` (uneven inputs: ranks with fewer batches shadow the others'
        collectives): refused, naming the fix."""
        raise StrategyError(
            f"{type(self).__name__} has no join(): uneven inputs are not shadowed as torch DDP's join() "
            "does, so every rank must run the same number of steps (each synchronized backward, and under "
            "ZeRO-3/FSDP each forward, is a collective). Give every rank the same number of batches: "
            "dtlab.data.DistributedSampler (as torch's: padded to equal length, or drop_last=True) and "
            "drop_last=True in the DataLoader"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside synchronizes."""
        raise NotImplementedError(f"{type(self).__name__} does not support no_sync()")
        yield

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch ``(inputs, targets)``; returns the detached loss."""
        inputs, targets = batch_pair(type(self).__name__, batch, loss_fn)  # or refused, before the forward
        loss = loss_fn(self(inputs), targets)
        loss.backward()
        return loss.detach()

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers keyed like ``module.state_dict()`` (collective: all ranks call)."""

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,  # noqa: ARG002 - torch's signature (positional destination is deprecated there)
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """torch's ``state_dict()`` speaking the plain module (keys without ``module.``): under DDP and
        ZeRO-1/2 (``module_copies``) the module's own, local and sharing the parameters' storage, as in
        torch; elsewhere whole copies, collective (every rank calls it, as FSDP2's full state dict)."""
        if self.module_copies:
            if destination is None:
                return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
            return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if keep_vars:
            raise StrategyError(
                f"{type(self).__name__}.state_dict(keep_vars=True): this rank holds only its part of "
                "the parameters (shards, slices or stages), so there are no whole live tensors to return. "
                "For the parameters themselves (names, requires_grad) use model.named_parameters(); for "
                "whole values model.state_dict() on every rank (copies: write changes back with "
                "model.load_state_dict(sd, strict=False))"
            )
        out: dict[str, Any] = destination if destination is not None else {}
        try:
            whole = self.full_state_dict()
        except (CollectiveTimeoutError, CollectiveMismatchError) as exc:  # if rank == 0: torch.save(...)
            who = f"{type(self).__name__}.state_dict() on rank {self.world_backend.rank}"
            fix = every_rank_saves("model.state_dict()", "its part of the model")
            raise StrategyError(f"{who} did not meet the other ranks: {fix} ({exc})") from exc
        out.update({prefix + k: v for k, v in whole.items()})
        return out

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        strict: bool = True,
        assign: bool = False,  # noqa: ARG002 - torch's signature; values are always copied into place
    ) -> _IncompatibleKeys:
        """Load whole tensors keyed like the plain module's ``state_dict()`` (a torch DDP checkpoint's
        ``module.`` prefix is accepted) into the wrapped model, each rank keeping its part. Collective:
        every rank calls it with the same tensors."""
        given = given_state(type(self).__name__, state_dict)
        current = self.full_state_dict()
        missing = [k for k in current if k not in given]
        unexpected = [k for k in given if k not in current]
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{type(self).__name__}.load_state_dict(): missing keys {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}; the state dict must be keyed like the plain "
                "module's state_dict() (or pass strict=False)"
            )
        whole = new_state(self.strategy_name, 1, 0)
        for k, now in current.items():
            t = given.get(k, now)
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{type(self).__name__}.load_state_dict(): {k!r} is not a tensor")
            add_slice(whole, k, t.shape, t.dtype, 0, t.numel(), t.reshape(-1))  # copied, detached
        self.load_sharded_state_dict([whole])
        return _IncompatibleKeys(missing, unexpected)

    @abstractmethod
    def sharded_state_dict(self) -> ShardedState:
        """This rank's shard of parameters and buffers with strategy metadata."""

    @abstractmethod
    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load from the shards of every saved rank (any world size, any data-parallel strategy)."""

    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer_state`` (filled by the
        optimizer strategy, 0 here), ``buffers`` and ``peak_gathered_parameters`` of the last step."""


class OptimizerTarget(ModelStrategy):
    """What an optimizer strategy drives: the trainable parameters, the synchronized gradients (whole
    or as flat shards), the global norm's parts and the step's bookkeeping."""

    @abstractmethod
    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter with ``requires_grad``, in registration order."""

    @abstractmethod
    def attach_optimizer(self, optimizer: AttachedOptimizer) -> None:
        """Called by the optimizer strategy; one optimizer strategy per model."""

    @abstractmethod
    def check_grads_ready(self, who: str) -> None:
        """Raise, naming ``who``, unless a synchronized backward ran since the last step."""

    @abstractmethod
    def shard_units(self) -> list[FlatUnit]:
        """The flat units whose shard this rank's optimizer steps (sharded optimizers only)."""

    @abstractmethod
    def shard_param(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of ``unit``'s parameters (the sharded optimizer steps it in place)."""

    @abstractmethod
    def shard_grad(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's averaged gradient of ``unit``'s shard."""

    @abstractmethod
    def after_optimizer_step(self) -> None:
        """Bring the parameters up to date after the optimizer changed its shards."""

    def gather_updated_shards(self) -> None:
        """After a sharded optimizer step on replicated parameters: every rank's updated shard to
        every rank (ZeRO-1/2); nothing where the strategy gathers on demand."""

    @abstractmethod
    def zero_grad_buffers(self, set_to_none: bool = True) -> None:
        """Zero the synchronized gradients (buffers keep their memory); ``set_to_none``: torch's, for
        :meth:`unused_params` (with ``False`` a parameter that had a gradient is stepped with zeros)."""

    def unused_params(self) -> frozenset[int]:
        """``id``s of the trainable parameters no rank computed a gradient for since the last
        ``zero_grad_buffers()`` (``find_unused_parameters=True``): the optimizer strategy leaves them
        out, as torch's optimizers skip a ``.grad`` of None."""
        return frozenset()

    @abstractmethod
    def scale_grads_(self, factor: float) -> None:
        """Multiply the synchronized gradients by ``factor`` (clipping)."""

    @abstractmethod
    def norm_grad_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """Gradient tensors for the global norm and whether they are replicated (True) or a partition
        of the global gradient across ranks (False: sum over :meth:`grad_norm_group`)."""

    @abstractmethod
    def grad_norm_group(self) -> CommunicationBackend:
        """The ranks whose :meth:`norm_grad_tensors` parts add up to the global norm."""

    def tied_names(self) -> dict[str, str]:  # where a pipeline holds a tied weight on several ranks
        return {}  # a parameter's other names -> its first (checkpoints without a pipeline hold that)

    @abstractmethod
    def placed(self, name: str) -> tuple[Placement, int, int]:
        """Parameter ``name``'s placement, this rank's coordinate on its axis and the axis size
        (checkpoints write and read optimizer state through it)."""
