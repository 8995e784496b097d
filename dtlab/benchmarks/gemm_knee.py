"""Fit ``dtlab advise``'s matrix-product term to this device: ``--tflops`` and ``--gemm-knee``.

A product of ``M x K`` by ``K x N`` is predicted to take ``2 M N K / (rate * eff)`` with
``eff = M/(M+k) * N/(N+k) * K/(K+k)``. This times ``torch.matmul`` on a grid of shapes (median of a
few runs each) and fits ``rate`` and ``k`` by least squares of the log time (``k`` on a grid, the
rate in closed form for each). Run once per device::

    python -m dtlab.benchmarks.gemm_knee                        # this machine's CPU, fp32
    python -m dtlab.benchmarks.gemm_knee --device cuda --dtype bf16 --max-dim 8192
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time(m: int, n: int, k: int, device: str, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def fit(rows: list[tuple[int, int, int, float]]) -> tuple[float, float, float]:
    """``(rate in FLOP/s, knee, rms log error)`` over ``(m, n, k, seconds)`` rows."""
    best = (0.0, 0.0, math.inf)
    for knee in [0.0, *[2 ** (i / 4) for i in range(4 * 4, 4 * 12 + 1)]]:  # 0, 16 .. 4096
        logs = []
        for m, n, k, t in rows:
            eff = (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee))
            logs.append(math.log(2 * m * n * k / eff / t))  # log rate this row implies
        log_rate = statistics.fmean(logs)
        err = math.sqrt(statistics.fmean((x - log_rate) ** 2 for x in logs))
        if err < best[2]:
            best = (math.exp(log_rate), knee, err)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--max-dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    dims = [d for d in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if d <= args.max_dim]
    big = dims[-1]
    shapes = {(d, big, big) for d in dims} | {(big, d, big) for d in dims} | {(big, big, d) for d in dims}
    shapes |= {(d, d, d) for d in dims} | {(m, n, k) for m, n, k in itertools.product(dims[-3:], repeat=3)}
    rows = [
        (m, n, k, _time(m, n, k, args.device, DTYPES[args.dtype], args.repeats)) for m, n, k in sorted(shapes)
    ]
    rate, knee, err = fit(rows)
    print(f"{args.device} {args.dtype}: --tflops {rate / 1e12:.4g} --gemm-knee {knee:.0f} "
          f"(rms error of the log time {err:.2f}, {len(rows)} shapes up to {big})")  # fmt: skip
    for m, n, k, t in rows:
        eff = (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee))
        print(f"  {m:>5} x {k:>5} x {n:>5}: {2 * m * n * k / t / 1e9:9.1f} GFLOP/s measured, "
              f"{rate * eff / 1e9:9.1f} predicted")  # fmt: skip


if __name__ == "__main__":
    main()
