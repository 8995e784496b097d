"""dtlab's MPIBackend against raw mpi4py, and dtlab's GlooBackend against raw torch.distributed.

Called by ``dtlab/benchmarks/collectives.py --backend mpi|gloo`` (``run(args) -> list[dict]``) or on its own:

    .venv/bin/python -m dtlab.benchmarks._engines --backend mpi --ranks 2,4 --sizes 4KiB,256KiB,4MiB,64MiB

One world of real processes per world size (``mpiexec`` for MPI, TCP on 127.0.0.1 for gloo). In that
world both variants run in the same process on the same buffers: for every (op, size) and every
round, a block of dtlab calls and a block of raw-engine calls (order alternating), each started after a
barrier and timed as the slowest rank's time per call; the best block of each is reported. Blocks are
short (about 200 us, at least one call) and as many as fit in 1.5 s per point (at least ``repeats``),
so that on a shared machine the best block is one that no other process disturbed.
Buffers are float32; ``size`` is the full buffer a rank holds (the all-reduced tensor, the
reduce-scatter input, the all-gather output). Raw calls: ``comm.Allreduce(MPI.IN_PLACE, a)``,
``comm.Reduce_scatter_block(a, b)``, ``comm.Allgather(a, b)`` on numpy views of the same tensors;
``dist.all_reduce``, ``dist.reduce_scatter_single``, ``dist.all_gather_single``. With ``--checked`` a
third variant in the same rounds: dtlab's call in checked mode (``backend.check_collectives = True``:
the ranks compare a 16-int description of each call first), reported as ``checked_us`` and
``checked/dtlab``. With ``--waits`` (MPI) two more variants in the same rounds, each an
``MPIBackend`` over a duplicate of the world's communicator: ``unwatched`` (``watchdog=None``: MPI's
blocking calls, unbounded) and ``polled`` (``timeout=1800``: every call non-blocking and polled, raising
after the timeout); dtlab's own variant is the default (blocking calls under the watchdog), reported
as ``dtlab/unwatched`` and ``polled/unwatched``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    import torch

    from dtlab.backends.base import CommunicationBackend


OPS = ("all_reduce", "reduce_scatter", "all_gather")


BLOCK_S = 200e-6  # target length of one timed block
POINT_BUDGET_S = 1.5  # seconds of timed calls per (op, size), both variants
MAX_ROUNDS = 400


def _raw_calls(
    b: CommunicationBackend, op: str, full: torch.Tensor, shard: torch.Tensor
) -> Callable[[], None]:
    """The raw engine's call for ``op`` on the same tensors dtlab uses."""
    from dtlab.backends import MPIBackend

    if isinstance(b, MPIBackend):
        from mpi4py import MPI

        comm, a, s = b.comm, full.numpy(), shard.numpy()
        if op == "all_reduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, a)
        if op == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(a, s)
        return lambda: comm.Allgather(s, a)
    import torch.distributed as dist

    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: rs(shard, full)
    return lambda: ag(full, shard)


def _dtlab_calls(
    b: CommunicationBackend, op: str, full: torch.Tensor, shard: torch.Tensor
) -> Callable[[], None]:
    if op == "all_reduce":
        return lambda: b.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: b.reduce_scatter(shard, full)
    return lambda: b.all_gather(full, shard)


def _slowest(b: CommunicationBackend, seconds: float) -> float:
    import torch

    from dtlab.backends import ReduceOp

    t = torch.tensor([seconds], dtype=torch.float64)
    b.all_reduce(t, ReduceOp.MAX)
    return float(t.item())


def bench_rank(
    b: CommunicationBackend,
    ops: list[str],
    sizes: list[int],
    iters: int,
    repeats: int,
    threads: int,
    checked: bool = False,
    waits: bool = False,
) -> list[dict[str, Any]]:
    """Runs on every rank of the world; returns the rows (the same on every rank). ``checked``: also
    time dtlab's calls in checked mode (``check_collectives``), in the same rounds; ``waits`` (MPI):
    also without the watchdog and polled (the module's docstring)."""
    import torch

    torch.set_num_threads(threads)
    p, rows = b.world_size, []
    others = _wait_variants(b) if waits else {}
    for op in ops:
        for nbytes in sizes:
            n = max(p, nbytes // 4 // p * p)
            full = torch.rand(n)
            shard = torch.rand(n // p)
            calls = {"dtlab": _dtlab_calls(b, op, full, shard), "raw": _raw_calls(b, op, full, shard)}
            if checked:
                calls["checked"] = calls["dtlab"]  # the same call, with b.check_collectives on
            for name, other in others.items():
                calls[name] = _dtlab_calls(other, op, full, shard)
            for name in calls:  # warm-up
                b.check_collectives = name == "checked"
                calls[name]()
                b.check_collectives = False
            b.barrier()
            t0 = time.perf_counter()
            for _ in range(3):
                calls["raw"]()
            est = _slowest(b, (time.perf_counter() - t0) / 3)  # the same on every rank
            # short blocks (about 200 us) and many of them: the best block is one no other process disturbed
            k = iters or max(1, min(64, int(BLOCK_S / est)))
            rounds = max(repeats, min(MAX_ROUNDS, int(POINT_BUDGET_S / (2 * k * est))))
            best = {name: float("inf") for name in calls}
            names = list(calls)
            for r in range(rounds):
                order = names if r % 2 == 0 else names[::-1]
                for name in order:
                    fn = calls[name]
                    b.barrier()
                    b.check_collectives = name == "checked"
                    t0 = time.perf_counter()
                    for _ in range(k):
                        fn()
                    dt = (time.perf_counter() - t0) / k
                    b.check_collectives = False
                    best[name] = min(best[name], _slowest(b, dt))
            rows.append(
                {
                    "backend": type(b).__name__,
                    "op": op,
                    "ranks": p,
                    "size": _show(nbytes),
                    "bytes": nbytes,
                    "dtlab_us": round(best["dtlab"] * 1e6, 1),
                    "raw_us": round(best["raw"] * 1e6, 1),
                    "ratio": round(best["dtlab"] / best["raw"], 3),
                }
            )
            if checked:
                rows[-1]["checked_us"] = round(best["checked"] * 1e6, 1)
                rows[-1]["checked/dtlab"] = round(best["checked"] / best["dtlab"], 3)
            if others:
                for name in others:
                    rows[-1][f"{name}_us"] = round(best[name] * 1e6, 1)
                rows[-1]["dtlab/unwatched"] = round(best["dtlab"] / best["unwatched"], 3)
                rows[-1]["polled/unwatched"] = round(best["polled"] / best["unwatched"], 3)
    for other in others.values():
        other.close()
    return rows


def _wait_variants(b: CommunicationBackend) -> dict[str, CommunicationBackend]:
    """``--waits``: the MPI backends without the watchdog and polled, over duplicates of ``b``'s
    communicator."""
    from dtlab.backends import MPIBackend
    from dtlab.errors import ArgumentError

    if not isinstance(b, MPIBackend):
        raise ArgumentError(f"--waits compares MPI's waits: use --backend mpi, got {type(b).__name__}")
    return {
        "unwatched": MPIBackend(b.comm.Dup(), watchdog=None),
        "polled": MPIBackend(b.comm.Dup(), timeout=1800.0, watchdog=None),
    }


def _show(n: int) -> str:
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (world size, op, size) for ``args.backend`` ("mpi" or "gloo"); one world per size."""
    from dtlab.testing import spawn_world

    rows: list[dict[str, Any]] = []
    for p in args.ranks:
        got = spawn_world(
            p,
            bench_rank,
            list(args.ops),
            list(args.sizes),
            args.iters,
            args.repeats,
            args.threads,
            getattr(args, "checked", False),
            getattr(args, "waits", False),
            backend=args.backend,
            timeout=3600,
            check_collectives=False,  # measured separately: --checked
        )
        rows.extend(got[0])
        for row in got[0]:
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit, m in (("MIB", 1 << 20), ("KIB", 1 << 10), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * m)
    return int(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["mpi", "gloo"], required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="4KiB,256KiB,4MiB,64MiB")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (default: by size)")
    ap.add_argument("--repeats", type=int, default=5, help="at least this many timed blocks per variant")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checked", action="store_true", help="also time checked mode (check_collectives)")
    ap.add_argument("--waits", action="store_true", help="MPI: also time no watchdog and polled waits")
    args = ap.parse_args(argv)
    if args.waits and args.backend != "mpi":
        ap.error(f"--waits compares MPI's ways to wait; use --backend mpi, got --backend {args.backend}")
    args.ops = [o for o in args.ops.split(",") if o]
    args.sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    rows = run(args)
    cols = [c for c in rows[0] if c != "bytes"]
    print("| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
