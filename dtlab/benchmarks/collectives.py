"""Time collectives and compare them with the memory-traffic bound; print a markdown table.

    .venv/bin/python -m dtlab.benchmarks.collectives                      # in-memory, the full grid
    .venv/bin/python -m dtlab.benchmarks.collectives --ranks 4 --sizes 4KiB,64MiB --ops all_reduce
    .venv/bin/python -m dtlab.benchmarks.collectives --backend mpi     # MPI/Gloo: _engines.py
    .venv/bin/python -m dtlab.benchmarks.collectives --backend gloo --checked   # + checked mode's cost
    .venv/bin/python -m dtlab.benchmarks.collectives --backend mpi --waits      # + unwatched and polled

Sizes are the full buffer every rank holds: the all-reduced tensor, the reduce-scatter input and the
all-gather output (as in nccl-tests). The *memory-traffic bound* is the minimal tensor work the same
collective needs, done in one thread on the same buffers: all_reduce ``P-1`` in-place adds and
``P-1`` copies; reduce_scatter ``P-1`` adds per output shard; all_gather ``P`` chunk copies per
output. Both are timed in the same run, alternately, with the same torch thread count; each figure
is the best of ``--repeats`` runs of ``--iters`` calls (for the collective: the slowest rank's time
per call).

Other engines plug in through ``dtlab/benchmarks/_engines.py``: ``run(args) -> list[dict]`` gets the parsed
arguments (``args.backend``, ``args.ops`` list of names, ``args.sizes`` list of bytes, ``args.ranks``
list of world sizes, ``args.iters`` (0: choose), ``args.repeats``, ``args.threads``) and returns one
dict per row; the table shows the keys of the first row as columns (``bytes`` is left out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.testing import run_world

OPS = ("all_reduce", "reduce_scatter", "all_gather")
UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def show_size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= UNITS[unit.upper()] and n % UNITS[unit.upper()] == 0:
            return f"{n // UNITS[unit.upper()]} {unit}"
    return f"{n} B"


def default_iters(nbytes: int) -> int:
    return max(3, min(300, (8 << 20) // max(nbytes, 1) * 3))


def buffers(op: str, nbytes: int, p: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(main, other) float32 buffers of one rank: the tensor, or (input, output) pairs."""
    n = nbytes // 4
    n -= n % p
    if op == "all_reduce":
        return torch.ones(n), None
    if op == "reduce_scatter":
        return torch.ones(n), torch.empty(n // p)
    return torch.ones(n // p), torch.empty(n)


def _call(
    b: CommunicationBackend, op: str, main: torch.Tensor, other: torch.Tensor | None
) -> Callable[[], None]:
    if op == "all_reduce":
        return lambda: b.all_reduce(main)
    if other is None:
        raise ValueError(f"{op} needs an output buffer")
    if op == "reduce_scatter":
        return lambda: b.reduce_scatter(other, main)
    return lambda: b.all_gather(other, main)


def _rank_timing(b: CommunicationBackend, op: str, nbytes: int, iters: int, threads: int) -> float:
    torch.set_num_threads(threads)
    main, other = buffers(op, nbytes, b.world_size)
    call = _call(b, op, main, other)
    call()  # warm-up (first touch of the pages)
    b.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def time_inmemory(op: str, nbytes: int, p: int, iters: int, threads: int) -> float:
    return max(run_world(p, _rank_timing, op, nbytes, iters, threads))


def bound_work(op: str, nbytes: int, p: int) -> Callable[[], None]:
    """The same collective's minimal tensor work, for one thread, on ``p`` ranks' buffers."""
    bufs = [buffers(op, nbytes, p) for _ in range(p)]
    mains = [m for m, _ in bufs]
    others = [o for _, o in bufs if o is not None]

    def all_reduce() -> None:
        acc = mains[0]
        for t in mains[1:]:
            acc.add_(t)
        for t in mains[1:]:
            t.copy_(acc)

    def reduce_scatter() -> None:
        n = others[0].numel()
        for r, out in enumerate(others):
            chunks = [t[r * n : (r + 1) * n] for t in mains]
            torch.add(chunks[0], chunks[1], out=out) if p > 1 else out.copy_(chunks[0])
            for c in chunks[2:]:
                out.add_(c)

    def all_gather() -> None:
        for out in others:
            torch.cat(mains, out=out)

    fn = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}[op]
    fn()  # first touch of the pages
    return fn


def time_calls(fn: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def run_inmemory(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    rows = []
    for op in args.ops:
        for p in args.ranks:
            for nbytes in args.sizes:
                iters = args.iters or default_iters(nbytes)
                work = bound_work(op, nbytes, p)
                t = bound = float("inf")
                for _ in range(args.repeats):  # alternate, so that both see the same machine load
                    t = min(t, time_inmemory(op, nbytes, p, iters, args.threads))
                    bound = min(bound, time_calls(work, iters))
                del work
                rows.append(
                    {
                        "backend": "inmemory",
                        "op": op,
                        "ranks": p,
                        "size": show_size(nbytes),
                        "bytes": nbytes,
                        "time_us": round(t * 1e6, 1),
                        "bound_us": round(bound * 1e6, 1),
                        "ratio": round(t / bound, 2),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no results)"
    cols = [c for c in rows[0] if c != "bytes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["inmemory", "mpi", "gloo"], default="inmemory")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB,64MiB", help="full buffer per rank, e.g. 4KiB,64MiB")
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated world sizes")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (default: by size)")
    ap.add_argument("--repeats", type=int, default=5, help="timings per point; the best is reported")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (per rank thread)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    ap.add_argument(
        "--checked",
        action="store_true",
        help="MPI/Gloo: also time checked mode (backend.check_collectives) in the same rounds",
    )
    ap.add_argument(
        "--waits",
        action="store_true",
        help="MPI: also time blocking calls without the watchdog, and polled ones (timeout=)",
    )
    args = ap.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"--ops: unknown {bad}; choose from {list(OPS)}")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError as exc:
        ap.error(f"--sizes/--ranks: {exc}")
    if args.checked and args.backend == "inmemory":
        ap.error("--checked: the in-memory world compares every call anyway; use --backend mpi or gloo")
    if args.waits and args.backend != "mpi":
        ap.error(f"--waits compares MPI's ways to wait; use --backend mpi, got --backend {args.backend}")
    if any(s < 4 for s in args.sizes) or any(r < 1 for r in args.ranks):
        ap.error(f"--sizes must be >= 4 bytes and --ranks >= 1, got {args.sizes} and {args.ranks}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "inmemory":
        rows = run_inmemory(args)
    else:
        from dtlab.benchmarks import _engines  # the MPI/Gloo comparison with the raw engines

        rows = _engines.run(args)
    print(f"torch {torch.__version__}, {args.threads} torch thread(s), best of {args.repeats}")
    print(markdown(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
