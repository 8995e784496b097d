"""More public entry points refusing a value of the wrong kind with one error naming the argument, the
value and what to pass, before anything reads it (see tests/test_entry_arguments.py): values that were
taken silently (a loss name where a function goes, an op name's typo, ``'no'`` taken as true) and
paths that were os's ``TypeError``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends import P2POp
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import consolidate, find_resume_checkpoint, load_pretrained
from dtlab.compression import OkTopk
from dtlab.core.rng import seeded_init
from dtlab.errors import ArgumentError, ArgumentTypeError, StrategyError
from dtlab.models import (
    ColumnParallelLinear,
    ColwiseParallel,
    DDPModel,
    HeadsParallel,
    PipelineParallelModel,
    RowParallelLinear,
    RowwiseParallel,
    SequenceParallel,
    ShardedState,
    VocabParallel,
    VocabParallelEmbedding,
    gpt2_plan,
    transformer_plan,
)
from dtlab.optimizers import GradScaler
from dtlab.testing import run_world
from dtlab.trainers import MetricsCollector, Profiler, StopRequest, SummedLoss, Task, stop_on_signals


def _net() -> nn.Module:
    with seeded_init(0):
        return nn.Linear(4, 2)


REFUSED: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    (
        "SummedLoss",
        lambda _: SummedLoss("mse"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "SummedLoss: loss must be a function",
    ),
    (
        "SummedLoss.count",
        lambda _: SummedLoss(torch.sub, count=3),  # type: ignore[arg-type]
        ArgumentTypeError,
        "SummedLoss: count",
    ),
    (
        "Profiler",
        lambda _: Profiler("x"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "Profiler: stats must be a backend's CommStats",
    ),
    (
        "P2POp",
        lambda _: P2POp("sendd", torch.ones(1), 1),  # type: ignore[arg-type]
        ArgumentError,
        "P2POp: kind must be 'send' or 'recv', got 'sendd'",
    ),
    (
        "ShardedState",
        lambda _: ShardedState(tensors="x"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "ShardedState: tensors must be a dict",
    ),
    (
        "ShardedState.values",
        lambda _: ShardedState({"w": [1.0]}),  # type: ignore[dict-item]
        ArgumentTypeError,
        "ShardedState: tensors",
    ),
    (
        "ShardedState.metadata",
        lambda _: ShardedState({}, "m"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "ShardedState: metadata",
    ),
    (
        "transformer_plan",
        lambda _: transformer_plan(sequence_parallel="yes"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "transformer_plan: sequence_parallel must be True or False, got 'yes'",
    ),
    (
        "MetricsCollector",
        lambda _: MetricsCollector(5),  # type: ignore[arg-type]
        ArgumentTypeError,
        "MetricsCollector: path must be the JSON Lines file to write (or None) (str or pathlib.Path), got 5",
    ),
    (
        "MetricsCollector.enabled",
        lambda p: MetricsCollector(p / "m.jsonl", enabled="no"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "MetricsCollector: enabled must be True or False",
    ),
    (
        "consolidate",
        lambda p: consolidate(p, None),  # type: ignore[arg-type]
        ArgumentTypeError,
        "consolidate: output must be the safetensors file to write",
    ),
    (
        "consolidate.checkpoint",
        lambda p: consolidate(None, p / "m.safetensors"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "consolidate: checkpoint must be",
    ),
    (
        "find_resume_checkpoint",
        lambda _: find_resume_checkpoint(5),  # type: ignore[arg-type]
        ArgumentTypeError,
        "find_resume_checkpoint: root must be the checkpoint directory",
    ),
    (
        "find_resume_checkpoint.strict",
        lambda p: find_resume_checkpoint(p, strict="no"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "find_resume_checkpoint: strict must be True or False",
    ),
    (
        "find_resume_checkpoint.check",
        lambda p: find_resume_checkpoint(p, check="x"),  # type: ignore[arg-type]
        ArgumentTypeError,
        "find_resume_checkpoint: check must be a function",
    ),
]


@pytest.mark.parametrize("who, call, error, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_value_taken_silently_or_failing_in_os_is_named(
    who: str, call: Callable[[Path], Any], error: type[Exception], message: str, tmp_path: Path
) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        call(tmp_path)
    assert not list(tmp_path.iterdir()), f"{who} wrote before refusing"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stop": "x"}, "stop_on_signals: stop must be a dtlab.trainers.StopRequest(), got str"),
        ({"signals": ("SIGTERM",)}, "stop_on_signals: signals must be a tuple of signal.Signals"),
        ({"exit_on_repeat": "no"}, "stop_on_signals: exit_on_repeat must be True or False, got 'no'"),
        ({"same_within": "1"}, "stop_on_signals: same_within must be a number of seconds"),
    ],
)
def test_stop_on_signals_names_a_value_of_the_wrong_kind(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"stop": StopRequest(), **kwargs}
    with pytest.raises(ArgumentTypeError, match="^" + re.escape(message)), stop_on_signals(**args):
        pass


def test_load_pretrained_strict_and_train_step_loss_are_refused_before_anything_runs(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in _net().state_dict().items()}, str(weights))

    def body(b: CommunicationBackend) -> None:
        model = DDPModel(_net(), b)
        with pytest.raises(
            ArgumentTypeError, match=r"^load_pretrained: strict must be True or False, got 'no'"
        ):
            load_pretrained(model, weights, strict="no")  # type: ignore[arg-type]
        calls: list[int] = []
        model.register_forward_pre_hook(lambda *_: calls.append(1))
        batch = (torch.ones(2, 4), torch.zeros(2, dtype=torch.long))
        with pytest.raises(
            StrategyError, match=r"^DDPModel.train_step\(batch, loss_fn\): loss_fn must be a func"
        ):
            model.train_step(batch, None)  # type: ignore[arg-type]
        with pytest.raises(
            StrategyError, match=r"^DDPModel.train_step\(batch, loss_fn\): batch must be the pair"
        ):
            model.train_step((*batch, batch[1]), nn.functional.cross_entropy)  # type: ignore[arg-type]
        assert calls == [], "the forward ran before the refusal"

    run_world(1, body)


SWITCHES: list[tuple[str, Callable[[], Any]]] = [
    ("GradScaler: enabled", lambda: GradScaler(enabled="no")),  # type: ignore[arg-type]
    ("OkTopk: error_feedback", lambda: OkTopk(error_feedback="no")),  # type: ignore[arg-type]
    ("Task: classification", lambda: Task(_net, [], [], classification="no")),  # type: ignore[arg-type]
    ("gpt2_plan: head", lambda: gpt2_plan(head="no")),  # type: ignore[arg-type]
    ("ColwiseParallel: gather_output", lambda: ColwiseParallel(gather_output="no")),  # type: ignore[arg-type]
    (
        "RowwiseParallel: input_is_parallel",
        lambda: RowwiseParallel(input_is_parallel="no"),  # type: ignore[arg-type]
    ),
    (
        "VocabParallel: sequence_parallel",
        lambda: VocabParallel(sequence_parallel="no"),  # type: ignore[arg-type]
    ),
    (
        "HeadsParallel: sequence_parallel",
        lambda: HeadsParallel(sequence_parallel="no"),  # type: ignore[arg-type]
    ),
    ("SequenceParallel: split_output", lambda: SequenceParallel(split_output="no")),  # type: ignore[arg-type]
]

TP_LAYERS: list[tuple[str, Callable[[CommunicationBackend], Any]]] = [
    (
        "ColumnParallelLinear: gather_output",
        lambda b: ColumnParallelLinear(4, 4, b, gather_output="no"),  # type: ignore[arg-type]
    ),
    (
        "ColumnParallelLinear: sequence_parallel",
        lambda b: ColumnParallelLinear(4, 4, b, sequence_parallel="no"),  # type: ignore[arg-type]
    ),
    (
        "RowParallelLinear: input_is_parallel",
        lambda b: RowParallelLinear(4, 4, b, input_is_parallel="no"),  # type: ignore[arg-type]
    ),
    ("RowParallelLinear: bias", lambda b: RowParallelLinear(4, 4, b, bias="no")),  # type: ignore[arg-type]
    (
        "VocabParallelEmbedding: sequence_parallel",
        lambda b: VocabParallelEmbedding(8, 4, b, sequence_parallel="no"),  # type: ignore[arg-type]
    ),
    (
        "ColumnParallelLinear: sequence_parallel",
        lambda b: ColumnParallelLinear.from_linear(_net(), b, sequence_parallel="no"),  # type: ignore[arg-type]
    ),
]


@pytest.mark.parametrize("who, call", SWITCHES, ids=[w for w, _ in SWITCHES])
def test_a_string_where_a_switch_goes_is_refused_not_taken_as_true(who: str, call: Callable[[], Any]) -> None:
    with pytest.raises(ArgumentTypeError, match=rf"^{who} must be True or False, got 'no'"):
        call()


def test_a_string_for_activation_checkpointing_or_a_tp_layer_option_is_refused_not_taken_as_true() -> None:
    def body(b: CommunicationBackend) -> None:
        for who, call in TP_LAYERS:
            with pytest.raises(ArgumentTypeError, match=rf"^{who} must be True or False, got 'no'"):
                call(b)
        with pytest.raises(
            ArgumentTypeError,
            match=r"^PipelineParallelModel: activation_checkpointing must be True or False, got 'no'",
        ):
            PipelineParallelModel(_net(), b, activation_checkpointing="no")  # type: ignore[arg-type]

    run_world(1, body)
