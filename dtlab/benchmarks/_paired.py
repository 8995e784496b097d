"""Implementations of one training step timed against each other in the same processes.

The variants alternate in blocks of ``steps`` steps for ``rounds`` rounds (the order reversed every
other round, after ``warmup`` steps each); each step is timed as the slowest rank's. Reported: each
variant's median step and interquartile range, the ratio of medians, and the median of the per-round
ratios of the two blocks' medians (the blocks ran back to back: robust to slow drifts in machine load).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    import torch

    from dtlab.backends.base import CommunicationBackend

Step = Callable[[], float]


def plain_step(loss_of: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Step:
    """A step: ``loss_of()`` (forward and loss), backward, ``opt.step()``, ``opt.zero_grad()``; the loss."""

    def step() -> float:
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def timed(backend: CommunicationBackend, step: Step) -> float:
    """One step after a barrier; its time as the slowest rank's (the same on every rank)."""
    import torch

    from dtlab.backends import ReduceOp

    backend.barrier()
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    backend.all_reduce(dt, ReduceOp.MAX)
    return float(dt.item())


def alternate(
    backend: CommunicationBackend, variants: dict[str, Step], rounds: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Each variant's step times, in order: ``warmup`` untimed steps each, then ``rounds`` rounds of one
    block of ``steps`` timed steps per variant, the order of the blocks reversed every other round."""
    for _ in range(warmup):
        for step in variants.values():
            step()
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            times[name].extend(timed(backend, variants[name]) for _ in range(steps))
    return times


def measure(backend: CommunicationBackend, variants: dict[str, Step], args: dict[str, Any]) -> dict[str, Any]:
    """Each variant's first step's loss (``"first_loss"``, a check that they train the same model), then
    :func:`alternate` with ``args``' ``rounds``, ``steps`` and ``warmup`` (``"times"``)."""
    first_loss = {name: step() for name, step in variants.items()}
    times = alternate(backend, variants, args["rounds"], args["steps"], args["warmup"])
    return {"times": times, "first_loss": first_loss}


def profile_table(step: Step, steps: int) -> str:
    """The top operators by self CPU time of ``steps`` calls of ``step`` on this rank (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return table


def blocks(times: list[float], steps: int) -> list[list[float]]:
    """The step times of :func:`alternate` cut into its blocks, one per round."""
    return [times[i : i + steps] for i in range(0, len(times), steps)]


def round_ratios(mine: list[float], theirs: list[float], steps: int) -> list[float]:
    """Per round, the median of ``mine``'s block over the median of ``theirs``'s."""
    pairs = zip(blocks(mine, steps), blocks(theirs, steps), strict=True)
    return [statistics.median(a) / statistics.median(b) for a, b in pairs]


def quartiles(ts: list[float]) -> tuple[float, float]:
    """The first and third quartiles (both the one value of a single time)."""
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    return q[0], q[2]


def add_timing_args(parser: argparse.ArgumentParser, steps: int, rounds: int) -> None:
    """``--steps --rounds --warmup --threads --json``, as :func:`alternate` and the report use them."""
    parser.add_argument("--steps", type=int, default=steps, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=rounds, help="blocks per variant (alternating order)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")


#: the tensor-parallel transformer's shape, as :func:`add_tp_transformer_args` reads it
TP_TRANSFORMER = ("d_model", "layers", "heads", "batch", "seq")


def add_tp_transformer_args(parser: argparse.ArgumentParser) -> None:
    """``--tp --d-model --layers --heads --batch --seq``: the built-in transformer at tensor parallelism."""
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)


def print_against_torch(title: str, res: dict[str, Any], steps: int) -> None:
    """The table of ``res["times"]`` (per variant) against the variant ``"torch"``, with each variant's
    ``res["first_loss"]``, and dtlab's per-round ratio to torch."""
    times: dict[str, list[float]] = res["times"]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    print(f"\n{title}\n")
    print("| implementation | step, median (IQR) | ratio to torch (median) | first loss |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        lo, hi = quartiles(ts)
        print(
            f"| {name} | {1e3 * med[name]:.0f} ms ({1e3 * lo:.0f}-{1e3 * hi:.0f}) | "
            f"{med[name] / med['torch']:.2f} | {res['first_loss'][name]:.6f} |"
        )
    paired = round_ratios(times["dtlab"], times["torch"], steps)
    lo, hi = quartiles(paired)
    print(
        f"\ndtlab / torch per round (block medians): median {statistics.median(paired):.2f} "
        f"(IQR {lo:.2f}-{hi:.2f}) over {len(paired)} rounds"
    )
