"""Time and per-rank bytes of every compression algorithm against dense, on real engines.

    python -m dtlab.benchmarks.compression                      # 25M elements, P=2,4, gloo+mpi,
                                                                     # plain + 10 Gbit/s + 1 Gbit/s
    python -m dtlab.benchmarks.compression --numel 4000000 --worlds 2 --rates plain --engines gloo

Each configuration runs in ONE spawned world (``dtlab.testing.spawn_world``): every rank pushes a
``numel``-element float32 gradient through a :class:`~dtlab.compression.CompressedReducer` (error
feedback, the non-finite check and statistics included: what a user gets), ``iters`` timed
iterations after warm-up, a barrier before each. Reported: the slowest rank's median seconds per
iteration and the bytes rank 0 sent (``backend.stats``, measured, next to each algorithm's formula).
Ok-Topk runs with ``tau=32``: its timed iterations reuse thresholds; the iteration that recomputes
them (exact top-k + radix select) is timed separately and the amortised time is
``(recompute + 31 * reuse) / 32``.

Bandwidth limits: the script creates its own network namespace (``ip netns``), shapes its loopback
with ``tc tbf`` (burst 256kb, one token bucket for all traffic on lo) and re-runs itself inside it;
the namespace is deleted on exit, also on failure, Ctrl-C, SIGTERM or SIGHUP. MPI then runs with
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_NOLOCAL=1`` so its traffic takes the shaped TCP
path instead of shared memory. Without root the shaped runs are skipped with a message. The
machine's own interfaces are never touched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import COMPRESSORS, CompressedReducer, Compressor, make_compressor
from dtlab.compression.powersgd import matrix_shape

ALGORITHMS = [name for name in COMPRESSORS if name != "bf16"]  # fp16 stands for both casts
TAU = 32


def make(name: str, density: float) -> Compressor:
    """No warm-up (every iteration is timed compressed); PowerSGD at rank 4; Ok-Topk with tau = TAU."""
    return make_compressor(name, density=density, warmup_steps=0, tau=TAU, tau_prime=2 * TAU, rank=4)


def formula(name: str, n: int, p: int, density: float, measured: dict[str, Any]) -> tuple[float, str]:
    """Bytes a rank sends per iteration by each algorithm's formula (ring convention of the backend)."""
    k, pair, flag = int(density * n), 8, 2 * (p - 1) * 4 * p // p
    if name == "dense":
        return 2 * (p - 1) / p * 4 * n, "2(P-1)/P * 4n"
    if name == "topka":
        return (p - 1) * k * pair + flag, "(P-1) k * 8"
    if name == "topkdsa":
        u = measured["selected"]
        return (k + u) * (p - 1) / p * pair + flag, "(k + U)(P-1)/P * 8, U = union"
    if name == "gtopk":
        return math.ceil(math.log2(p)) * (k * pair + 8) + (k + 1) * 8 + 2 * (p - 1) / p * 4 * k, (
            "log2(P)(8k) + 8k bcast + 2(P-1)/P 4k  [max over ranks]"
        )
    if name == "gaussiank":
        return (p - 1) * measured["local_selected"] * pair + flag, "(P-1) k' * 8, k' = local selection"
    if name == "oktopk":
        return 6 * k * (p - 1) / p * pair, "bound 6k(P-1)/P * 8"
    if name == "randomk":
        return 2 * (p - 1) / p * 4 * k + flag, "2(P-1)/P * 4k"
    if name == "qsgd":
        return (p - 1) * (n + 4 * math.ceil(n / 512)) + flag, "(P-1)(n + 4n/512)"
    if name == "powersgd":
        rows, cols = matrix_shape(n)
        return 2 * (p - 1) / p * 4 * 4 * (rows + cols) + flag, "2(P-1)/P * 4r(rows+cols)"
    return 2 * (p - 1) / p * 2 * n + flag, "2(P-1)/P * 2n"


def rs_formula(name: str, n: int, p: int, density: float) -> tuple[float | None, str]:
    """Reduce-scatter semantics: dense and Ok-Topk's reduced form (split-and-reduce only)."""
    if name == "dense":
        return (p - 1) / p * 4 * n, "(P-1)/P * 4n"
    if name == "oktopk":
        return int(density * n) * 8, "bound k * 8 (split-and-reduce only)"
    return None, "-"


def bench_rank(
    backend: CommunicationBackend,
    numel: int,
    density: float,
    algorithms: list[str],
    iters: int,
    semantics: str = "all_reduce",
) -> dict[str, Any]:
    """One rank of one configuration: every algorithm, timed (module level: spawned processes import it).

    Each algorithm's timed iterations alternate with dense ones (dense, algorithm, dense, ...), so
    every iteration of an algorithm has a dense iteration of the same moment to be compared with:
    the per-iteration times of both are returned, and the ratio is taken per round."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(17 + backend.rank)
    scale = torch.linspace(0.05, 1.0, numel)
    grads = [torch.randn(numel, generator=gen) * scale for _ in range(2)]
    buf = torch.empty(numel)
    shard = torch.empty(numel // backend.world_size)
    dense = CompressedReducer(backend, make("dense", density), dense_below=0)

    def once(red: CompressedReducer, i: int) -> tuple[float, dict[str, Any]]:
        buf.copy_(grads[i % 2])
        backend.barrier()
        red.start_step()
        t0 = time.perf_counter()
        if semantics == "reduce_scatter":  # numel is a multiple of P (see run_configs)
            red.reduce_scatter("g", buf, shard).wait()
        else:
            red.all_reduce("g", buf).wait()
        return time.perf_counter() - t0, red.step_statistics()

    once(dense, 0)
    out: dict[str, Any] = {}
    for name in algorithms:
        red = dense if name == "dense" else CompressedReducer(backend, make(name, density), dense_below=0)
        first, _ = once(red, 0)  # warm-up (Ok-Topk: the iteration that recomputes thresholds)
        times, dense_times, stats = [], [], []
        for i in range(iters):
            dense_times.append(once(dense, i + 1)[0])
            dt, st = once(red, i + 1)
            times.append(dt)
            stats.append(st)
        out[name] = {
            "times": times,
            "dense_times": dense_times,
            "first_seconds": first,
            "bytes_sent": max(s["bytes_sent"] for s in stats),
            "bytes_received": max(s["bytes_received"] for s in stats),
            "selected": stats[-1].get("density", 0.0) * numel,
            "local_selected": stats[-1].get("local_density", 0.0) * numel,
            "select_seconds": statistics.median(s["select_seconds"] for s in stats),
            "variant": stats[-1].get("variant"),
        }
        del red
    return out


def run_configs(args: argparse.Namespace, rate: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for engine in args.engines:
        for p in args.worlds:
            for semantics in args.semantics:
                rows += _one_config(args, rate, engine, p, semantics)
    return rows


def _one_config(
    args: argparse.Namespace, rate: str, engine: str, p: int, semantics: str
) -> list[dict[str, Any]]:
    from dtlab.testing import spawn_world

    numel = args.numel - args.numel % p if semantics == "reduce_scatter" else args.numel
    t0 = time.time()
    try:
        per_rank = spawn_world(
            p, bench_rank, numel, args.density, args.algorithms, args.iters, semantics,
            backend=engine, timeout=args.timeout, check_collectives=False,
        )  # fmt: skip
    except Exception as exc:  # report and go on with the other configurations
        print(
            f"[{rate}] {engine} P={p} {semantics}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True
        )
        return []
    rows = []
    for name in args.algorithms:
        r = _timing(name, per_rank)
        r0 = per_rank[0][name]
        f: float | None
        if semantics == "all_reduce":
            f, text = formula(name, numel, p, args.density, r0)
        else:
            f, text = rs_formula(name, numel, p, args.density)
        rows.append(
            {"rate": rate, "engine": engine, "P": p, "semantics": semantics, "algorithm": name, **r,
             "variant": r0["variant"], "rank0_bytes_sent": r0["bytes_sent"], "formula_bytes": f,
             "formula": text, "selected": r0["selected"], "local_selected": r0["local_selected"],
             "select_seconds": r0["select_seconds"]}
        )  # fmt: skip
    print(f"[{rate}] {engine} P={p} {semantics}: done in {time.time() - t0:.0f}s", flush=True)
    return rows


def _timing(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """An iteration's time is its slowest rank's; ``seconds``: the median (Ok-Topk: amortised over
    ``TAU``, ``(first + (TAU - 1) * reuse) / TAU``); ``speedup``: the median over rounds of the dense
    iteration's time over the algorithm's (the dense one timed right before it)."""
    times = [max(ts) for ts in zip(*(pr[name]["times"] for pr in per_rank), strict=True)]
    dense = [max(ts) for ts in zip(*(pr[name]["dense_times"] for pr in per_rank), strict=True)]
    first = max(pr[name]["first_seconds"] for pr in per_rank)
    r: dict[str, Any] = {"seconds": statistics.median(times), "first_seconds": first}
    r["bytes_sent"] = max(pr[name]["bytes_sent"] for pr in per_rank)
    r["dense_seconds"] = statistics.median(dense)
    if name == "oktopk":
        times = [(first + (TAU - 1) * t) / TAU for t in times]
        r["amortised_seconds"] = statistics.median(times)
    r["speedup"] = statistics.median(d / t for d, t in zip(dense, times, strict=True))
    return r


def shaped(args: argparse.Namespace, rate: str) -> list[dict[str, Any]]:
    """Re-run this script inside a fresh namespace whose loopback is limited to ``rate``."""
    if os.geteuid() != 0:
        print(f"[{rate}] skipped: shaping needs root (ip netns + tc); run as root to measure it", flush=True)
        return []
    ns = f"dtlab-bench-{os.getpid()}"
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", rate, "burst", "256kb", "latency", "50ms"],
            check=True,
        )  # fmt: skip
        env = dict(os.environ, MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp", MPIR_CVAR_NOLOCAL="1")
        env["GLOO_SOCKET_IFNAME"] = "lo"
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dtlab.benchmarks.compression"]
        cmd += ["--inner", rate, "--inner-out", out]
        cmd += ["--numel", str(args.numel), "--density", str(args.density), "--iters", str(args.iters)]
        cmd += ["--timeout", str(args.timeout), "--engines", *args.engines]
        cmd += ["--worlds", *map(str, args.worlds), "--algorithms", *args.algorithms]
        cmd += ["--semantics", *args.semantics]
        subprocess.run(cmd, env=env, check=True)
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text())
        return rows
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        Path(out).unlink(missing_ok=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| link | engine | P | semantics | algorithm | s/iter | dense s/iter (same rounds) | vs dense "
        "| sent (rank 0) | formula | formula bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sem = r.get("semantics", "all_reduce")
        # Ok-Topk under reduce-scatter runs without boundary balancing and global selection: say so
        algo = (
            f"{r['algorithm']} (reduced: no balancing, no global phase)"
            if r.get("variant")
            else r["algorithm"]
        )
        fb = "-" if r["formula_bytes"] is None else f"{r['formula_bytes'] / 1e6:.2f} MB"
        sec = r.get("amortised_seconds", r["seconds"])
        speed = f"{r['speedup']:.2f}x"
        lines.append(
            f"| {r['rate']} | {r['engine']} | {r['P']} | {sem.replace('_', '-')} | {algo} | {sec:.3f} "
            f"| {r['dense_seconds']:.3f} | {speed} | "
            f"{r['rank0_bytes_sent'] / 1e6:.2f} MB | {r['formula']} | {fb} |"
        )
    return "\n".join(lines)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGHUP become ``SystemExit``: ``finally`` blocks run and the namespace is deleted (the
    shell's ``trap ... EXIT``); a running shaped child is killed by ``subprocess.run`` on the way out."""
    raise SystemExit(128 + signum)


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--engines", nargs="+", default=["gloo", "mpi"], choices=["gloo", "mpi"])
    ap.add_argument("--rates", nargs="+", default=["plain", "10gbit", "1gbit"])
    ap.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    ap.add_argument(
        "--semantics",
        nargs="+",
        default=["all_reduce"],
        choices=["all_reduce", "reduce_scatter"],
        help="all_reduce (DDP, ZeRO-1 with gradient_sync=all_reduce) and/or reduce_scatter (ZeRO-1's "
        "default, ZeRO-2/3, FSDP: Ok-Topk runs without boundary balancing and global selection)",
    )
    ap.add_argument(
        "--local-rounds",
        type=int,
        default=5,
        help="rounds of the local-work table (each compressor's work per element against a 3-stream "
        "add, one thread; dtlab.benchmarks.compression_local); 0: skip it",
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path, default=None, help="also write every row here")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inner-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner is not None:  # inside the shaped namespace
        Path(args.inner_out).write_text(json.dumps(run_configs(args, args.inner)))
        return
    if args.local_rounds > 0:
        from dtlab.benchmarks import compression_local

        local = compression_local.measure(args.numel, args.local_rounds, args.density)
        load = compression_local.load_average()
        print(compression_local.table(local, args.numel, load) + "\n", flush=True)
    rows: list[dict[str, Any]] = []
    for rate in args.rates:
        rows += run_configs(args, rate) if rate == "plain" else shaped(args, rate)
    print(f"\n{args.numel} elements, density {args.density}, {args.iters} timed iterations\n")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
