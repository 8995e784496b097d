"""Running one rank's share of a pipeline schedule: forwards, backwards, input- and weight-gradients.

The rank's compute actions run in order; before each, :class:`~dtlab.models.pipeline._comm.StageLinks`
posts the communication the schedule places there. The last stage runs backward from
``loss_fn(output, targets) / m`` per micro-batch, so the accumulated gradients are those of the mean
loss over the whole batch (never scaled after the fact). Activation memory is counted from the tensors
(:class:`ActivationMeter`, docs/strategies.md, "What it costs"); a storage held by two micro-batch
records (a local hand-over between stages) counts once. A parameter a user's custom autograd Function
saves comes back from the meter's hooks as a :class:`~dtlab.core.saved_params.SavedParameter`, so a
``backward`` writing its ``.grad`` by hand writes the parameter's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtlab.core.saved_params import SavedParameter, custom_function_saves
from dtlab.errors import StrategyError
from dtlab.models.checkpointing import checkpointed
from dtlab.models.pipeline._comm import StageLinks
from dtlab.models.pipeline._schedules import Action, Kind, PipelineSchedule
from dtlab.models.pipeline._zb import SplitLinearMode, WeightGradients
from dtlab.models.step_args import described

__all__ = [
    "GRAPHLESS_LOSS",
    "ActivationMeter",
    "StepResult",
    "check_stage_checkpointing",
    "run_schedule",
]

Key = tuple[int, int]  # (stage, micro-batch)


class ActivationMeter:
    """Bytes of activation storages held per (stage, micro-batch), and the peak of their union."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded  # storage data pointers of parameters
        self.peak = 0
        self._held: dict[Key, dict[int, int]] = {}  # storage data pointer -> bytes

    def _add(self, key: Key, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if nbytes and ptr not in self.excluded:
            self._held.setdefault(key, {})[ptr] = nbytes

    @contextlib.contextmanager
    def saving(self, key: Key) -> Iterator[None]:
        """Inside: every tensor autograd saves is recorded for ``key``."""

        def pack(t: torch.Tensor) -> Any:
            # a parameter a user's Function saves (its storage is not counted): kept as itself, handed
            # back as a SavedParameter (torch rewraps what an unpack hook returns: a .grad written on
            # it would be lost)
            if (
                t.requires_grad
                and t.is_leaf
                and custom_function_saves(sys._getframe(1))  # noqa: SLF001 - the saving frame
                and isinstance(t, nn.Parameter)
            ):
                return _Kept(t)
            self._add(key, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def hold(self, key: Key, tensors: Sequence[torch.Tensor]) -> None:
        """Record ``tensors`` for ``key`` as well, then count everything recorded (each storage once)."""
        for t in tensors:
            self._add(key, t)
        union = {ptr: nbytes for held in self._held.values() for ptr, nbytes in held.items()}
        self.peak = max(self.peak, sum(union.values()))

    def release(self, key: Key) -> None:
        self._held.pop(key, None)


@dataclass(frozen=True)
class _Kept:
    """A parameter a custom Function saved (see :meth:`ActivationMeter.saving`)."""

    param: nn.Parameter


def _unpack(obj: Any) -> torch.Tensor:
    if isinstance(obj, _Kept):
        return SavedParameter(obj.param, obj.param.detach())
    return obj  # type: ignore[no-any-return]


@dataclass
class StepResult:
    """The last stage's summed loss (``sum_i loss_i / m``; None elsewhere), the peak activation bytes
    and the measured compute intervals ``(action, start, end)`` (``perf_counter`` seconds, from the
    arrival of the action's inputs to its end)."""

    loss: torch.Tensor | None
    peak_activation_bytes: int
    timeline: list[tuple[Action, float, float]]
    #: every micro-batch's loss had no graph from an output that had one (the last stage's rank): the
    #: caller refuses it on every rank (:data:`GRAPHLESS_LOSS`), after the step's all-reduce over pp
    graphless: bool


#: the refusal of a step whose every micro-batch's loss had no graph (a micro-batch's constant loss, no
#: targets in it, may skip alone)
GRAPHLESS_LOSS = (
    "loss_fn returned a loss that does not require grad from an output that does, for every micro-batch "
    "(computed from output.detach(), under torch.no_grad(), or through .item()), so no gradient reached any "
    "stage; compute the loss from the output itself, as loss.backward() needs in one process"
)


@dataclass
class _Step:
    """One step's state on a rank while its actions run."""

    schedule: PipelineSchedule
    rank: int
    stages: Mapping[int, Callable[[torch.Tensor, int], torch.Tensor]]  # (input, micro-batch)
    links: StageLinks | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    meter: ActivationMeter
    xs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage inputs, until their backward
    ys: dict[Key, torch.Tensor] = field(default_factory=dict)  # outputs (last stage: the scaled loss)
    #: the gradient of each stage's output from the next stage's backward, sent (SEND_B) or handed over
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    deferred: dict[Key, WeightGradients] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    #: micro-batches whose loss had no graph from an output that had one (their backward is skipped)
    detached: int = 0

    def outgoing(self, a: Action) -> torch.Tensor:
        if a.kind is Kind.SEND_F:
            return self.ys[(a.stage, a.micro)].detach()
        return self.grads.pop((a.stage - 1, a.micro))

    def forward(self, a: Action, x: torch.Tensor, target: torch.Tensor) -> None:
        key, last = (a.stage, a.micro), self.schedule.num_stages - 1
        split: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if self.schedule.name == "zero_bubble":
            split = SplitLinearMode(self.deferred.setdefault(key, WeightGradients()))
        with self.meter.saving(key), split:
            y = self.stages[a.stage](x, a.micro)
            if a.stage == last:
                out, y = y, _mean_loss(self.loss_fn(y, target)) / self.schedule.m
                self.detached += not y.requires_grad and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0]
                )
        self.meter.hold(key, [x, y])
        self.xs[key], self.ys[key] = x, y
        if a.stage == last:
            self.loss_sum = y.detach() if self.loss_sum is None else self.loss_sum + y.detach()

    def stage_input(self, a: Action, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        if a.stage == 0:
            return inputs[a.micro]
        if self.schedule.rank_of(a.stage - 1) != self.rank and self.links is not None:
            x = self.links.take(Kind.RECV_F, a.stage, a.micro)
        else:
            x = self.ys[(a.stage - 1, a.micro)].detach()
        return x.requires_grad_(x.is_floating_point())

    def output_grad(self, a: Action) -> torch.Tensor | None:
        key = (a.stage, a.micro)
        if a.stage == self.schedule.num_stages - 1:
            return None
        if self.schedule.rank_of(a.stage + 1) != self.rank and self.links is not None:
            return self.links.take(Kind.RECV_B, *key)
        return self.grads.pop(key)

    def backward(self, a: Action, grad: torch.Tensor | None) -> None:
        key = (a.stage, a.micro)
        y, x = self.ys.pop(key), self.xs.pop(key)
        if y.requires_grad:
            torch.autograd.backward(y, grad)
        if a.stage > 0:
            self.grads[(a.stage - 1, a.micro)] = x.grad if x.grad is not None else torch.zeros_like(x)
        self.meter.release(key)
        if a.kind is Kind.I:  # until its W, the key holds what the W needs
            self.meter.hold(key, self.deferred[key].held_tensors())


def _mean_loss(loss: object) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        hint = (
            "; the model gets no labels here (output.loss is None): use output.logits"
            if loss is None
            else "; return the loss alone (train_step returns it; a metric goes with model(x) in evaluation)"
            if isinstance(loss, Mapping | tuple | list)
            else "; a Python number has no gradient: return the tensor, not loss.item()"
            if isinstance(loss, int | float)
            else ""
        )
        got = described(loss)
        raise StrategyError(
            f"loss_fn must return a scalar tensor (the micro-batch's mean loss), got {got}{hint}"
        )
    return loss.reshape(())


def run_schedule(
    schedule: PipelineSchedule,
    rank: int,
    stages: Mapping[int, Callable[[torch.Tensor, int], torch.Tensor]],
    links: StageLinks | None,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    excluded_storages: set[int],
    checkpointing: bool,
    modules: Mapping[int, nn.Module],
) -> StepResult:
    """Execute ``schedule.actions[rank]`` with this rank's ``stages`` (each called with its input and the
    micro-batch's index) on the micro-batches. With ``checkpointing`` each stage's forward keeps only
    its input and recomputes the rest in its backward (``torch.utils.checkpoint``, non-reentrant),
    leaving the running statistics in each stage's module (``modules``) as its forward left them."""
    if checkpointing:
        stages = {s: checkpointed(run, modules[s]) for s, run in stages.items()}
    step = _Step(schedule, rank, stages, links, loss_fn, ActivationMeter(excluded_storages))
    timeline: list[tuple[Action, float, float]] = []
    computes = schedule.compute(rank)
    for j, a in enumerate(computes):
        if links is not None:
            links.post(j, step.outgoing)
        t0 = perf_counter()  # compute intervals start once the inputs have arrived
        if a.kind is Kind.F:
            x = step.stage_input(a, inputs)
            t0 = perf_counter()
            step.forward(a, x, targets[a.micro])
        elif a.kind in (Kind.B, Kind.I):
            grad = step.output_grad(a)
            t0 = perf_counter()
            step.backward(a, grad)
        else:  # W
            step.deferred.pop((a.stage, a.micro)).run()
            step.meter.release((a.stage, a.micro))
        timeline.append((a, t0, perf_counter()))
    if links is not None:
        links.post(len(computes), step.outgoing)
        links.finish()
    return StepResult(step.loss_sum, step.meter.peak, timeline, graphless=step.detached == schedule.m)


def check_stage_checkpointing(enabled: bool, schedule: str, owner: str) -> None:
    """Zero-bubble splits each backward into input- and weight-gradient parts through its own
    autograd functions, which a recomputed forward would not reproduce: refused, naming the fix."""
    if enabled and schedule == "zero_bubble":
        raise StrategyError(
            f"{owner}(activation_checkpointing=True, schedule='zero_bubble'): zero-bubble defers the "
            "weight gradients of the forward it recorded, which a checkpointed stage recomputes "
            "differently; use gpipe, 1f1b or interleaved_1f1b with checkpointing, or zero_bubble "
            "without it"
        )
