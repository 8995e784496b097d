"""What an activation checkpoint's replayed draws cost on an in-memory rank: one checkpointed block of
the built-in transformer (dropout 0.1), forward + backward, timed on an in-memory rank's thread (its
random numbers drawn from a generator of the region's own: every op of the forward and of its
recomputation passes a torch dispatch mode) and on a plain thread (torch's own checkpoint, as in a
process), alternately, one thread at a time. Prints the fastest of each (the least disturbed by
other work on the machine) and how many ops the forward runs.
Run::

    python -m dtlab.benchmarks.checkpointing_draws
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.backends.threads import RankThread
from dtlab.core import seeded_init
from dtlab.models.checkpointing import checkpoint_modules
from dtlab.zoo import Block

#: (d_model, heads, batch, tokens)
SIZES = ((64, 1, 8, 32), (128, 2, 8, 64), (256, 4, 8, 128))


class _Ops(TorchDispatchMode):
    """Counts the ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _on(thread_class: type[threading.Thread], fn: Callable[[], float]) -> float:
    out: list[float] = []
    t = thread_class(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| block (d_model, batch x tokens) | ops per forward | plain thread (ms) | in-memory rank (ms) | "
          "vs plain | added per op (us) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for d, heads, batch, tokens in SIZES:
        with seeded_init(0):
            block = Block(d, heads, 0.1)
        ops = _Ops()
        with torch.no_grad(), ops:
            block(torch.zeros(batch, tokens, d))
        checkpoint_modules(block)
        x = torch.randn(batch, tokens, d, generator=torch.Generator().manual_seed(0), requires_grad=True)

        def step(block: Block = block, x: torch.Tensor = x) -> float:
            t0 = time.perf_counter()
            block(x).sum().backward()
            return time.perf_counter() - t0

        times: dict[type[threading.Thread], list[float]] = {threading.Thread: [], RankThread: []}
        for _ in range(args.repeats + 1):  # the first of each: warm-up
            for kind, seen in times.items():
                seen.append(_on(kind, step))
        plain, rank = (1e3 * min(t[1:]) for t in times.values())
        added = 1e3 * (rank - plain) / (2 * ops.count)  # the forward and its recomputation
        print(f"| {d}, {batch} x {tokens} | {ops.count} | {plain:.2f} | {rank:.2f} | {rank / plain:.2f}x | "
              f"{added:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
