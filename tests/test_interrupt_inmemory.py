"""Ctrl-C (KeyboardInterrupt) in a caller waiting for an in-memory ``run_training`` stops the rank
threads after their step, as ``dtlab train``'s SIGINT does (a final checkpoint when ``checkpoint.dir``
is set), then raises ``KeyboardInterrupt`` saying where the run stopped; a second one leaves the ranks
behind at once. The interrupt is delivered from rank 0's loss function with ``_thread.interrupt_main``."""

from __future__ import annotations

import _thread
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dtlab.config import TrainConfig, load_config
from dtlab.testing import TINY_LM
from dtlab.trainers import StopRequest, Task, Trainer, build_task, run_training

BOUND = 30.0  # seconds: every wait here


def _cfg(*extra: str) -> TrainConfig:
    sets = [
        *TINY_LM,
        "train.eval_every=0",
        "logging.progress=false",
        "logging.run_dir=null",
        "train.steps=200",
    ]
    return load_config(overrides=["backend.name=inmemory", *sets, *extra])


def _until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND
    while not cond():
        assert time.monotonic() < deadline, "test wait bound reached"
        time.sleep(0.01)


def _run_stop() -> StopRequest:
    """The StopRequest of the Trainer whose loss function calls this (found up the rank's stack)."""
    frame = inspect.currentframe()
    while frame is not None:
        found = frame.f_locals.get("self")
        if isinstance(found, Trainer) and found.stop is not None:
            return found.stop
        frame = frame.f_back
    raise AssertionError("no Trainer with a stop request on this thread's stack")


def _interrupting(at_call: int, twice: threading.Event | None = None) -> Task:
    """The tiny LM task whose loss function, on rank 0 at its ``at_call``-th call, interrupts the main
    thread and waits until the run's stop is requested (so the run stops after that very step); with
    ``twice``, interrupts again and then waits for ``twice`` (the caller has given up on the ranks)."""
    base = build_task(_cfg())
    calls = [0]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "dtlab-rank-0":
            calls[0] += 1
            if calls[0] == at_call:
                stop = _run_stop()
                _thread.interrupt_main()
                _until(stop.is_set)
                if twice is not None:
                    _thread.interrupt_main()
                    _until(twice.is_set)
        return base.loss_fn(logits, targets)

    return Task(base.build_model, base.train_data, base.eval_data, loss_fn, base.tokens_per_sample)


@pytest.fixture
def sigint() -> Iterator[None]:
    runner = signal.getsignal(signal.SIGINT)  # a pytest-xdist worker ignores SIGINT: Python's own here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, runner)


def _ranks() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("dtlab-rank", "dtlab-world"))}


@pytest.mark.parametrize("ws", [1, 2])
def test_keyboard_interrupt_stops_the_ranks_after_the_step(sigint: None, tmp_path: Path, ws: int) -> None:
    before = _ranks()
    ck = tmp_path / "ck"
    cfg = _cfg(f"backend.world_size={ws}", f"checkpoint.dir={ck}")
    with pytest.raises(KeyboardInterrupt) as raised:
        run_training(cfg, task=_interrupting(3))
    assert _ranks() <= before  # every rank thread has ended: nothing trains behind the caller
    step = ck / "step_00000003"
    assert str(raised.value) == (
        f"dtlab: training stopped by KeyboardInterrupt after step 3 of 200 (every rank); checkpoint {step}"
    )
    assert (ck / "latest").read_text().strip() == step.name
    resumed = run_training(
        _cfg(f"backend.world_size={ws}", f"checkpoint.dir={ck}", "checkpoint.resume=true", "train.steps=4")
    )
    assert resumed[0].final_step == 4


def test_without_checkpoint_dir_and_with_the_callers_stop_request(sigint: None) -> None:
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt, match=r"after step 2 of 200 \(every rank\); no checkpoint"):
        run_training(_cfg("backend.world_size=2"), task=_interrupting(2), stop=stop)
    assert stop.reason == "KeyboardInterrupt"


def test_a_second_interrupt_leaves_the_ranks_at_once(sigint: None) -> None:
    before = _ranks()
    released = threading.Event()
    try:
        with pytest.raises(KeyboardInterrupt, match="left running after a second KeyboardInterrupt"):
            run_training(_cfg("backend.world_size=2"), task=_interrupting(2, twice=released))
        assert _ranks() - before  # the caller returned while rank 0 still waits in its step
    finally:
        released.set()
    _until(lambda: not (_ranks() - before))  # the stop stays requested: they end after that step
