"""Preemption: SIGTERM (what schedulers and torchrun send first) or SIGINT stops training cleanly.

The signal handler only sets a :class:`StopRequest`; every rank's :class:`~dtlab.trainers.Trainer`
reads it at each step boundary and the ranks agree (one MAX all-reduce of a flag, so one signalled
rank is enough and all stop after the same step), write a final checkpoint when ``checkpoint.dir``
is set, and return with ``TrainResult.preempted_by`` naming the signal. ``dtlab train`` then exits
with ``EXIT_STATUS`` (128 + the signal number, as a shell reports a process the signal ended: 143 for
SIGTERM, 130 for SIGINT).

Handlers are installed once, in the main thread (in-memory ranks are threads: never per rank). After
the first signal, by default, the previous handlers are back, so a second signal acts at once as it
would without dtlab: SIGINT raises ``KeyboardInterrupt``, SIGTERM ends the process.

``dtlab train`` asks for ``exit_on_repeat``: signals within ``same_within`` seconds of the first are
the same request (a terminal or ``timeout`` delivers one signal to a process group, so a process may
get it twice), and a later one, while the run stops, exits at once with ``EXIT_STATUS`` through
``os._exit``: no interpreter teardown under running rank threads or engine threads (which is what
aborted with "terminate called without an active exception"). Every committed checkpoint stays
intact (a save is atomic; an interrupted one leaves only its ``.tmp-*`` directory) and the
``StopRequest``'s cleanups run first (the Trainer releases its checkpoint directory's lock there).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dtlab.backends._run_args import check_timeout
from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.checkpoint.files import step_dir_name
from dtlab.errors import ArgumentTypeError, check_switches
from dtlab.trainers.run_view import Progress

if TYPE_CHECKING:
    from dtlab.config import TrainConfig
    from dtlab.trainers.progress import ProgressBar
    from dtlab.trainers.result import TrainResult

__all__ = [
    "EXIT_STATUS",
    "PreemptedRun",
    "StopRequest",
    "agreed_stop",
    "check_stop",
    "exit_on_signals",
    "finish_process",
    "preempt",
    "stop_on_signals",
]

#: exit status of ``dtlab train`` after a clean stop on a signal: 128 + the signal number
EXIT_STATUS = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}


class StopRequest:
    """A request to stop training at the next step boundary; thread-safe, set once (first reason wins)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self._cleanups: list[Callable[[], None]] = []

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """``fn`` runs before an exit on a repeated signal (``stop_on_signals(exit_on_repeat=True)``)."""
        with self._lock:
            self._cleanups.append(fn)

    def remove_cleanup(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._cleanups:
                self._cleanups.remove(fn)

    def exit_now(self, signum: int) -> None:
        """Run the cleanups, say why on stderr and end the process at once with ``128 + signum``."""
        with self._lock:
            cleanups = list(self._cleanups)
        for fn in cleanups:
            try:
                fn()
            except Exception:  # best effort: the process ends either way
                pass
        name = signal.Signals(signum).name
        msg = (
            f"\ndtlab: {name} again while stopping ({self.reason}): exiting now with status {128 + signum}; "
            "every checkpoint committed before is intact (a save in progress is abandoned, its .tmp-* "
            "directory left)\n"
        )
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(2, msg.encode())
        finally:
            os._exit(128 + signum)

    def request(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def check_stop(who: str, stop: object, or_none: str = "") -> None:
    """Refuses a ``stop`` that is not a :class:`StopRequest` (``who``: the call it was given to)."""
    if not isinstance(stop, StopRequest):
        raise ArgumentTypeError(
            f"{who}: stop must be a dtlab.trainers.StopRequest(){or_none}, got {type(stop).__name__}"
        )


@contextmanager
def stop_on_signals(
    stop: StopRequest,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    exit_on_repeat: bool = False,
    same_within: float = 0.5,
) -> Iterator[StopRequest]:
    """While inside, the first of ``signals`` sets ``stop`` (named after the signal) and puts the
    previous handlers back; on leaving, the previous handlers are back in any case. Main thread only
    (Python's rule for signal handlers): elsewhere this installs nothing.

    ``exit_on_repeat``: the handlers stay; a signal within ``same_within`` seconds of the first is the
    same request, a later one ends the process at once (``StopRequest.exit_now``, see above)."""
    check_stop("stop_on_signals", stop)
    if not (isinstance(signals, tuple | list) and all(isinstance(s, signal.Signals) for s in signals)):
        raise ArgumentTypeError(
            "stop_on_signals: signals must be a tuple of signal.Signals, e.g. (signal.SIGTERM,), got "
            f"{signals!r}"
        )
    check_switches("stop_on_signals", exit_on_repeat=exit_on_repeat)
    check_timeout("stop_on_signals", "same_within", same_within)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous: dict[signal.Signals, Any] = {s: signal.getsignal(s) for s in signals}

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    first: list[float] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        if not exit_on_repeat:
            stop.request(signal.Signals(signum).name)
            restore()  # a second signal: the behaviour without dtlab, at once
            return
        if not first:
            first.append(time.monotonic())
            stop.request(signal.Signals(signum).name)
        elif time.monotonic() - first[0] > same_within:
            stop.exit_now(signum)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        restore()


def exit_on_signals(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """For the rest of the process (main thread only): one of ``signals`` ends it at once with 128 + its
    number, output flushed, no traceback. ``dtlab train`` sets this once its work is done, so that a
    signal during the interpreter's teardown does not turn into a ``KeyboardInterrupt`` there."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    for s in signals:
        signal.signal(s, handler)


def finish_process() -> None:
    """For a program whose work is done and which is about to exit (``dtlab train``, a torchrun worker
    script): a signal from now on ends it at once (:func:`exit_on_signals`), and the interpreter's last
    full garbage collection skips every object that exists now (``gc.freeze()``). That collection walks
    the hundreds of thousands of objects importing torch made, none of them garbage: 1 to 2 CPU-seconds
    of each process's exit, which under torchrun every membership change waits for (its agent sends
    SIGTERM and rendezvous again once the worker is gone). Nothing else is skipped: atexit handlers
    run, output is flushed, objects are released by reference counting as before; only objects in
    reference cycles that exist now are left to the process's end (Python does not promise to finalize
    objects alive at exit either)."""
    exit_on_signals()
    gc.freeze()


def agreed_stop(backend: CommunicationBackend, stop: StopRequest) -> str | None:
    """Collective, at a step boundary: the reason if any rank's ``stop`` is set (then on every rank),
    else ``None``. One 4-byte MAX all-reduce per call; the reasons travel only once a stop is agreed."""
    flag = torch.tensor([1 if stop.is_set() else 0], dtype=torch.int32, device=backend.device)
    backend.all_reduce(flag, ReduceOp.MAX)
    if not int(flag.item()):
        return None
    reasons = backend.all_gather_object(stop.reason)
    return next((r for r in reasons if r), "stop request")


class PreemptedRun(Progress, Protocol):
    """What :func:`preempt` reads of a run (a Trainer is one) and the final checkpoint it asks for."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def backend(self) -> CommunicationBackend: ...
    def save_checkpoint(self) -> Path: ...


def preempt(trainer: PreemptedRun, stop: StopRequest, result: TrainResult, bar: ProgressBar) -> bool:
    """Collective, at a step boundary: ``False`` while no rank's ``stop`` is set; else every rank stops
    here, after a final checkpoint when ``checkpoint.dir`` is set (unless this step was just saved),
    with ``result.preempted_by``, a ``preempted_by`` metrics record and lines on rank 0's stderr."""
    reason = agreed_stop(trainer.backend, stop)
    if reason is None:
        return False
    result.preempted_by = reason

    def say(text: str) -> None:  # above the progress bar when it is shown
        if trainer.is_main and bar.enabled:
            bar.print_line(text)
        elif trainer.is_main:
            print(text, file=sys.stderr, flush=True)

    say(f"dtlab: {reason}: every rank stops after step {trainer.step}")
    record: dict[str, Any] = {"step": trainer.step, "preempted_by": reason}
    if trainer.config.checkpoint.dir:
        if result.checkpoint is None or Path(result.checkpoint).name != step_dir_name(trainer.step):
            t0 = time.perf_counter()
            result.checkpoint = str(trainer.save_checkpoint())
            record["checkpoint_s"] = time.perf_counter() - t0
        record["checkpoint"] = result.checkpoint
        say(f"dtlab: checkpoint {result.checkpoint} written")
    trainer.metrics.log(record)
    return True
