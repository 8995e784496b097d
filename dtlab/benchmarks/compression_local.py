"""Each compressor's local work per element, next to a memory-traffic bound timed in the same run.

    python -m dtlab.benchmarks.compression_local                    # 25M elements, 9 rounds
    python -m dtlab.benchmarks.compression_local --numel 4000000 --rounds 5

*Local work* is one :class:`~dtlab.compression.CompressedReducer` call on a one-rank world, so nothing
travels and what is timed is everything a rank does to the buffer itself: the error-feedback add
(``grad + residual``), the non-finite check, the compressor's selection or quantization, writing the
result back and the residual update. The *bound* is a 3-stream ``torch.add(a, b, out=c)`` over the
same number of float32 elements (two reads, one write: the traffic of the error-feedback add alone).
One thread (``torch.set_num_threads(1)``), timed as that thread's CPU time (``time.thread_time``:
on a loaded machine the time the thread waits for a core is not counted, the time it waits for
memory is), rounds interleaved (in each round the bound, then every compressor once, in turn), and
the ratio taken per round before the median: a slow moment slows the bound and the compressor of
the same round alike.

PowerSGD multiplies the gradient (as a ``rows x cols`` matrix) by its rank-4 factors three times
(``P = M Q``, ``Q = M^T P``, the residual ``M - P Q^T``) and its result is one more product. On a CPU
its kernels make those products streaming passes; what the same three products cost through
``torch.mm`` (MKL, far from streaming speed on these skinny shapes) is timed in the same rounds and
reported next to it ("3 GEMMs"), with PowerSGD's ratio to those products plus the add.

Ok-Topk has two kinds of iteration: the one that recomputes its thresholds (an exact top-k, every
``tau`` iterations) and the ones that reuse them; both are reported, and ``oktopk`` is the amortised
``(recompute + (tau - 1) reuse) / tau``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.inmemory import InMemoryWorld
from dtlab.compression import CompressedReducer, make_compressor
from dtlab.compression.powersgd import matrix_shape

__all__ = ["measure", "table"]

#: compressors measured (bf16 is fp16's twin); Ok-Topk's two iteration kinds are split out
NAMES = ["dense", "topka", "topkdsa", "gtopk", "gaussiank", "oktopk", "randomk", "qsgd", "powersgd", "fp16"]
TAU = 32


def _gradients(numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(17)
    scale = torch.linspace(0.05, 1.0, numel)
    return [torch.randn(numel, generator=gen) * scale for _ in range(2)]


def _reducers(names: list[str], density: float) -> dict[str, CompressedReducer]:
    backend = InMemoryWorld(1, timeout=600).backend(0)
    out = {}
    for name in names:
        comp = make_compressor(name, density=density, warmup_steps=0, tau=TAU, tau_prime=2 * TAU, rank=4)
        out[name] = CompressedReducer(backend, comp, dense_below=0)
    if "oktopk" in names:  # tau = 1: every iteration recomputes (exact top-k, exact global threshold)
        comp = make_compressor("oktopk", density=density, warmup_steps=0, tau=1, tau_prime=1)
        out["oktopk-recompute"] = CompressedReducer(backend, comp, dense_below=0)
    return out


def measure(
    numel: int, rounds: int, density: float = 0.01, names: list[str] | None = None
) -> list[dict[str, Any]]:
    """Median seconds per call of every compressor and of the bound, and the median per-round ratio."""
    torch.set_num_threads(1)
    reducers = _reducers(names or NAMES, density)
    grads = _gradients(numel)
    a, b, c = grads[0].clone(), grads[1].clone(), torch.empty(numel)
    buf = torch.empty(numel)
    calls = dict.fromkeys(reducers, 0)

    def call(name: str) -> float:
        buf.copy_(grads[calls[name] % 2])
        calls[name] += 1
        t0 = time.thread_time()
        reducers[name].all_reduce("g", buf).wait()
        return time.thread_time() - t0

    gemm = _gemms(numel) if "powersgd" in reducers else None
    for name in reducers:  # first call: buffers allocated, thresholds found
        call(name)
    times: dict[str, list[float]] = {n: [] for n in ["bound", *reducers]}
    ratios: dict[str, list[float]] = {n: [] for n in times}
    gemm_times: list[float] = []
    for _ in range(rounds):
        t0 = time.thread_time()
        torch.add(a, b, out=c)
        bound = time.thread_time() - t0
        times["bound"].append(bound)
        ratios["bound"].append(1.0)
        if gemm is not None:
            gemm_times.append(gemm())
        for name in reducers:
            if name == "oktopk" and calls[name] % TAU == 0:
                call(name)  # the recomputing iteration is timed by oktopk-recompute
            dt = call(name)
            times[name].append(dt)
            ratios[name].append(dt / bound)
            if name == "powersgd":
                ratios["powersgd vs GEMMs + bound"] = [
                    *ratios.get("powersgd vs GEMMs + bound", []),
                    dt / (bound + gemm_times[-1]),
                ]
    rows: list[dict[str, Any]] = []
    for name, ts in times.items():
        sec, ratio = statistics.median(ts), statistics.median(ratios[name])
        label = "oktopk-reuse" if name == "oktopk" else name
        rows.append({"name": label, "seconds": sec, "ns_per_element": sec / numel * 1e9, "vs_bound": ratio})
        if name == "powersgd":
            rows[-1]["vs_gemm_bound"] = statistics.median(ratios["powersgd vs GEMMs + bound"])
            g = statistics.median(gemm_times)
            vs = statistics.median(gt / bt for gt, bt in zip(gemm_times, times["bound"], strict=True))
            rows.append(
                {
                    "name": "powersgd's 3 GEMMs alone",
                    "seconds": g,
                    "ns_per_element": g / numel * 1e9,
                    "vs_bound": vs,
                }
            )
    if "oktopk" in reducers:
        reuse = next(r for r in rows if r["name"] == "oktopk-reuse")
        rec = next(r for r in rows if r["name"] == "oktopk-recompute")
        amortised = {
            k: (rec[k] + (TAU - 1) * reuse[k]) / TAU for k in ("seconds", "ns_per_element", "vs_bound")
        }
        rows.append({"name": f"oktopk (amortised, tau={TAU})", **amortised})
    return rows


def _gemms(numel: int) -> Callable[[], float]:
    """PowerSGD's three rank-4 products on a matrix of ``numel`` elements (its flat-buffer shape),
    timed as one thread's CPU time."""
    rows, cols = matrix_shape(numel)
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(rows, cols, generator=gen)
    q, p, prod = torch.randn(cols, 4, generator=gen), torch.empty(rows, 4), torch.empty(rows, cols)

    def run() -> float:  # as PowerSGD multiplies: every product streams the matrix row by row
        t0 = time.thread_time()
        torch.mm(m, q.t().contiguous().t(), out=p)
        q.copy_(torch.mm(p.t().contiguous(), m).t())
        torch.mm(p, q.t(), out=prod)
        return time.thread_time() - t0

    return run


def table(rows: list[dict[str, Any]], numel: int, load: str) -> str:
    lines = [
        f"Local work per element, {numel} float32 elements, 1 thread, load average {load}:",
        "",
        "| compressor | ms per call | ns per element | vs 3-stream add (bound) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        extra = f" ({r['vs_gemm_bound']:.2f}x its GEMMs + the add)" if "vs_gemm_bound" in r else ""
        ms, ns = f"{r['seconds'] * 1e3:.1f}", f"{r['ns_per_element']:.2f}"
        lines.append(f"| {r['name']} | {ms} | {ns} | {r['vs_bound']:.2f}x{extra} |")
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--algorithms", nargs="+", default=NAMES, choices=NAMES)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    before = load_average()
    rows = measure(args.numel, args.rounds, args.density, args.algorithms)
    load = f"{before} before, {load_average()} after"
    print(table(rows, args.numel, load))
    if args.json is not None:
        args.json.write_text(json.dumps({"numel": args.numel, "load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
