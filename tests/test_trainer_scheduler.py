"""The Trainer's LR scheduler: what a ``scheduler_factory`` returns is checked when the Trainer is
built (one clear error naming the value and the fix); a scheduler of one's own (no torch class)
trains and resumes; after a resume, the rates a torch scheduler reports are set through its
``load_state_dict``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dtlab.config import TrainConfig, load_config
from dtlab.errors import ArgumentTypeError, ConfigError, RankFailedError
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training
from dtlab.trainers.scheduler import (
    check_scheduler,
    load_scheduler_state,
    scheduler_state,
    set_scheduler_rates,
)

TINY = ["backend.name=inmemory", *TINY_LM, "train.eval_every=0", "logging.progress=false"]


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    return load_config(overrides=[*TINY, f"logging.run_dir={tmp / 'run'}", *extra])


def _sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


class HalveEvery:
    """A scheduler of one's own, no torch class: halves the learning rates every ``every`` steps."""

    def __init__(self, opt: torch.optim.Optimizer, every: int) -> None:
        self.opt, self.every, self.count = opt, every, 0
        self.base = [float(g["lr"]) for g in opt.param_groups]

    def step(self) -> None:
        self.count += 1
        for group, base in zip(self.opt.param_groups, self.base, strict=True):
            group["lr"] = base * 0.5 ** (self.count // self.every)

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = int(state_dict["count"])


class LastLrAsList(HalveEvery):
    """The rates kept in an attribute named like the method: not callable."""

    get_last_lr = (0.1,)  # type: ignore[assignment]


def _forgot_return(opt: torch.optim.Optimizer) -> Any:
    """A factory that builds the scheduler and forgets to return it (typed ``-> Any``: mypy would
    refuse a factory typed ``-> None``)."""
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)


def test_what_is_not_a_scheduler_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as info:
        run_training(_cfg(tmp_path, "train.steps=2"), scheduler_factory=_forgot_return)
    cause = info.value.__cause__
    assert isinstance(cause, ArgumentTypeError), cause
    assert "scheduler_factory returned None (a factory without a return?), not an LR scheduler" in str(cause)
    assert "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100)" in str(cause)  # the fix
    assert not (tmp_path / "run").exists()  # raised by Trainer(): no run directory, nothing trained
    # a scheduler built beforehand instead of a function building one: before any rank starts
    built: Any = torch.optim.lr_scheduler.StepLR(_sgd(), 2)
    with pytest.raises(ArgumentTypeError, match=r"scheduler_factory=<StepLR> is not callable"):
        run_training(_cfg(tmp_path), scheduler_factory=built)
    opt = _sgd()
    with pytest.raises(
        ArgumentTypeError, match=r"returned <SGD>, not an LR scheduler: it has no get_last_lr\(\)"
    ):
        check_scheduler(opt)
    # get_last_lr as a list instead of a method: isinstance() of the Protocol only sees the name
    with pytest.raises(
        ArgumentTypeError, match=r"returned <LastLrAsList>, not an LR scheduler: it has no get_last_lr"
    ):
        check_scheduler(LastLrAsList(opt, 2))
    # an LRScheduler subclass, but its step needs a metric the Trainer does not pass
    with pytest.raises(ArgumentTypeError, match=r"ReduceLROnPlateau, whose step\(\) needs metrics"):
        check_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    assert check_scheduler(sched) is sched
    own = HalveEvery(opt, 2)
    assert check_scheduler(own) is own


def test_a_scheduler_of_your_own_trains_and_resumes(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    cfg = _cfg(tmp_path, "train.steps=4", "logging.log_every=1", "optimizer.lr=0.01", f"checkpoint.dir={ck}")
    run_training(cfg, scheduler_factory=lambda opt: HalveEvery(opt, 2))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [r["lr"] for r in map(json.loads, lines) if "lr" in r] == pytest.approx(
        [0.01, 0.005, 0.005, 0.0025]
    )
    resumed = _cfg(
        tmp_path, "train.steps=6", "logging.log_every=1", "optimizer.lr=0.01", f"checkpoint.resume={ck}"
    )
    run_training(resumed, scheduler_factory=lambda opt: HalveEvery(opt, 2))
    lrs = [
        r["lr"]
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "lr" in r
    ]
    assert lrs[4:] == pytest.approx([0.0025, 0.00125])  # its count came back from the checkpoint


def test_rates_set_after_a_resume_are_what_the_scheduler_reports_and_schedules_from() -> None:
    opt = _sgd(0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(3):
        opt.step()
        sched.step()
    saved = json.loads(json.dumps(scheduler_state(sched)))  # as a checkpoint keeps it
    fresh_opt = _sgd(0.05)  # the resumed run's config halves the learning rate
    fresh = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (1 + s))
    loaded = load_scheduler_state(fresh, saved)
    assert loaded["base_lrs"] == [0.1] and fresh.get_last_lr() == pytest.approx([0.1 / 4])
    fresh_opt.param_groups[0]["lr"] = 0.05 / 4
    set_scheduler_rates(fresh, [0.05], [0.05 / 4])
    assert fresh.get_last_lr() == pytest.approx([0.05 / 4])
    assert fresh.state_dict()["base_lrs"] == [0.05] and fresh.last_epoch == 3
    fresh_opt.step()
    fresh.step()
    assert fresh.get_last_lr() == pytest.approx([0.05 / 5])  # on from the new base rate
    set_scheduler_rates(fresh, [], [0.01])  # no base rates given: only the last rates are set
    assert fresh.state_dict()["base_lrs"] == [0.05] and fresh.get_last_lr() == [0.01]
    own = HalveEvery(_sgd(), 2)
    set_scheduler_rates(own, [0.05], [0.01])  # neither entry in its state: left as it is
    assert own.get_last_lr() == [0.1] and own.state_dict() == {"count": 0}


def test_a_one_cycle_shorter_than_the_run_is_refused_before_it_starts(tmp_path: Path) -> None:
    # before: torch's raw "Tried to step 6 times. The specified number of total steps is 5" on every rank
    # at step 6 of 8, after the steps before it had trained
    short = ["optimizer.schedule=torch", "optimizer.torch_scheduler=OneCycleLR", "train.steps=8"]
    with pytest.raises(ConfigError, match=r"OneCycleLR from optimizer.torch_scheduler_args\) runs 5 steps"):
        _cfg(tmp_path, *short, 'optimizer.torch_scheduler_args={"max_lr": 0.01, "total_steps": 5}')
    _cfg(tmp_path, *short, 'optimizer.torch_scheduler_args={"max_lr": 0.01}')  # train.steps given to it

    def one_cycle(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=5)

    with pytest.raises(RankFailedError) as info:
        run_training(_cfg(tmp_path, "train.steps=8"), scheduler_factory=one_cycle)
    assert isinstance(info.value.__cause__, ValueError)
    text = str(info.value.__cause__)
    assert "(OneCycleLR from scheduler_factory) runs 5 steps (total_steps=5) but train.steps=8" in text
    assert "Give it total_steps=8" in text and "or set train.steps=5" in text
    assert not (tmp_path / "run").exists()  # refused by Trainer(): nothing trained
