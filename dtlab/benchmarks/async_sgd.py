"""AsyncSGDOptimizer against synchronous DDP with one slow worker: throughput and loss against time.

    .venv/bin/python -m dtlab.benchmarks.async_sgd                          # 1 seed, about 3 minutes
    .venv/bin/python -m dtlab.benchmarks.async_sgd --seeds 0,1,2 --json out.json --plot docs/img/async_sgd.png

One MPI world of 4 processes (``mpiexec``, started by ``dtlab.testing.spawn_world``): rank 0 is the
parameter server, ranks 1-3 are workers. Task: scikit-learn's 8x8 digits (80% train / 20% held out,
dtlab's fixed split) with dtlab's ``DigitsCNN``; each worker owns a third of the training set and
reads it in batches of 16 (global batch 48), SGD lr 0.05, momentum 0.9, for ``--epochs`` epochs, the
same initial weights in every variant. Worker rank 3 sleeps a fixed delay per step: by default the
measured mean compute time of one step (its computing takes twice as long), or ``--delay-ms``.

Variants: ``ddp`` (DDPModel + DDPOptimizer over the three workers; rank 0 idles), and
AsyncSGDOptimizer with staleness 0, 2, 4, 8 and None. Reported per variant (mean over seeds): wall
time (from a common start until the last worker finished its share), samples/s while every worker is
busy (the samples all workers finished before the first one ran out of data, over that time),
held-out accuracy of the final parameters, the largest staleness a read had, the WAIT notes the
workers got (reads held back by the bound), and the training loss against time (all workers'
mini-batch losses in time order, averaged over a sliding window of ``--window`` steps). All variants
use an ``MPIBackend`` with a timeout, which bounds every wait and polls instead of spinning. torch's
first optimizer step (which imports its compiler) happens before any timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.data import load_digits_dataset
from dtlab.errors import ArgumentError
from dtlab.models import DDPModel
from dtlab.optimizers import AsyncSGDOptimizer, DDPOptimizer
from dtlab.trainers.models import DigitsCNN

VARIANTS: list[str | int | None] = ["ddp", 0, 2, 4, 8, None]
BATCH, LR, MOMENTUM = 16, 0.05, 0.9
SLOW = 3  # the worker made slower


def name_of(variant: str | int | None) -> str:
    return "ddp" if variant == "ddp" else f"s={variant}"


def build(seed: int) -> nn.Module:
    with seeded_init(seed):  # the same initial weights on every rank and in every variant
        return DigitsCNN()


def shard(x: torch.Tensor, y: torch.Tensor, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``workers``-th sample from ``worker`` on, all shards cut to one size (equal step counts)."""
    n = len(y) // workers
    return x[worker::workers][:n], y[worker::workers][:n]


def calibrate(b: CommunicationBackend, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean compute time of one worker step (forward + backward of a batch), over the workers."""
    spent = torch.zeros(1, dtype=torch.float64)
    warm = nn.Parameter(torch.zeros(1))  # torch's first optimizer step imports its compiler: not timed
    warm.grad = torch.ones(1)
    torch.optim.SGD([warm], lr=1.0).step()
    if b.rank > 0:
        net = build(0)
        times = []
        for i in range(30):
            t0 = time.perf_counter()
            part = slice(i * BATCH, (i + 1) * BATCH)
            nn.functional.cross_entropy(net(x[part]), y[part]).backward()
            times.append(time.perf_counter() - t0)
        spent[0] = sorted(times[5:])[len(times[5:]) // 2]
    b.all_reduce(spent)
    return float(spent[0]) / (b.world_size - 1)


def run_variant(
    b: CommunicationBackend,
    workers_group: CommunicationBackend | None,
    variant: str | int | None,
    seed: int,
    epochs: int,
    delay: float,
    data: dict[str, torch.Tensor],
) -> dict[str, Any] | None:
    workers = b.world_size - 1
    net = build(seed)
    log: list[tuple[float, float]] = []
    ddp: DDPOptimizer | None = None  # the ddp variant, on the workers
    async_opt: AsyncSGDOptimizer | None = None  # the other variants, on every rank
    if variant == "ddp":
        if workers_group is not None:
            ddp = DDPOptimizer(DDPModel(net, workers_group), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    else:
        staleness = None if variant is None else int(variant)
        async_opt = AsyncSGDOptimizer(
            net, b, torch.optim.SGD, lr=LR, momentum=MOMENTUM, staleness=staleness, num_servers=1
        )
    b.barrier()
    start = time.perf_counter()
    if b.rank > 0:
        x, y = shard(data["x"], data["y"], b.rank - 1, workers)
        gen = torch.Generator().manual_seed(1000 * seed + b.rank)
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(len(y) // BATCH):
                idx = order[i * BATCH : (i + 1) * BATCH]
                if b.rank == SLOW:
                    time.sleep(delay)
                if ddp is not None:
                    ddp.zero_grad()
                    loss = ddp.model.train_step((x[idx], y[idx]), nn.functional.cross_entropy)
                    ddp.step()
                elif async_opt is not None:
                    loss = nn.functional.cross_entropy(async_opt.module(x[idx]), y[idx])
                    loss.backward()
                    async_opt.step()
                log.append((time.perf_counter() - start, loss.detach().item()))
        if async_opt is not None:
            async_opt.finish()
    elif async_opt is not None:
        async_opt.serve()
    end = time.perf_counter() - start
    stats = async_opt.stats() if async_opt is not None else {}
    if async_opt is None:  # ddp: the workers' replica travels to rank 0, which evaluates
        flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
        if b.rank == 1:
            b.send(flat, 0, tag=11)
        elif b.rank == 0:
            b.recv(flat, 1, tag=11)
            torch.nn.utils.vector_to_parameters(flat, net.parameters())
        state = net.state_dict()
    else:
        state = async_opt.full_state_dict()
    everyone = b.all_gather_object({"end": end, "log": log, "stats": stats})
    if b.rank != 0:
        return None
    net.load_state_dict(state)
    with torch.no_grad():
        accuracy = float((net(data["tx"]).argmax(1) == data["ty"]).float().mean()) * 100
    wall = max(e["end"] for e in everyone[1:])
    first = min(e["end"] for e in everyone[1:])  # until then every worker is busy
    busy = sum(1 for e in everyone[1:] for t, _ in e["log"] if t <= first) * BATCH
    return {
        "variant": name_of(variant),
        "seed": seed,
        "wall_s": wall,
        "samples_per_s": busy / first,
        "accuracy": accuracy,
        "logs": [e["log"] for e in everyone[1:]],
        "stats": [e["stats"] for e in everyone],
    }


def bench_world(
    b: CommunicationBackend,
    variants: list[str | int | None],
    seeds: list[int],
    epochs: int,
    delay_ms: float | None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    full = load_digits_dataset()
    train, held = full.split(0.2)
    data = {"x": train.inputs, "y": train.targets, "tx": held.inputs, "ty": held.targets}
    from dtlab.backends import MPIBackend

    if not isinstance(b, MPIBackend):
        raise ArgumentError(f"the async SGD benchmark runs on MPI (backend='mpi'), got {type(b).__name__}")
    timed = MPIBackend(b.comm.Dup(), timeout=600.0)
    group = timed.new_group(list(range(1, b.world_size)))
    delay = calibrate(timed, data["x"], data["y"]) if delay_ms is None else delay_ms / 1000
    rows = []
    for seed in seeds:
        for variant in variants:
            row = run_variant(timed, group, variant, seed, epochs, delay, data)
            if row is not None:
                rows.append(row)
                print(
                    f"{row['variant']:7s} seed {seed}: {row['wall_s']:6.1f}s  "
                    f"{row['samples_per_s']:7.0f} samples/s  accuracy {row['accuracy']:.2f}%",
                    file=sys.stderr,
                    flush=True,
                )
    return {"delay_s": delay, "rows": rows}


# ---------------------------------------------------------------------------------------------- output
def smooth(logs: list[list[tuple[float, float]]], window: int) -> tuple[list[float], list[float]]:
    """All workers' (time, loss) points in time order, loss averaged over the last ``window`` points."""
    points = sorted(p for log in logs for p in log)
    times, losses = [], []
    for i in range(window, len(points) + 1, max(1, window // 4)):
        chunk = points[i - window : i]
        times.append(chunk[-1][0])
        losses.append(mean(v for _, v in chunk))
    return times, losses


def table(rows: list[dict[str, Any]], delay: float) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    sync = mean(r["accuracy"] for r in rows if r["variant"] == "ddp") if "ddp" in names else None
    lines = [
        f"slow worker: +{delay * 1000:.1f} ms per step",
        "| variant | wall s | samples/s | accuracy % | vs ddp | max staleness | WAIT notes | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        rs = [r for r in rows if r["variant"] == n]
        acc = mean(r["accuracy"] for r in rs)
        stale = max((s.get("max_staleness", 0) for r in rs for s in r["stats"] if s), default=0)
        waits = sum(s.get("waits", 0) for r in rs for s in r["stats"][1:] if s) / len(rs)
        diff = "" if sync is None else f"{acc - sync:+.2f}"
        lines.append(
            f"| {n} | {mean(r['wall_s'] for r in rs):.1f} | {mean(r['samples_per_s'] for r in rs):.0f} | "
            f"{acc:.2f} | {diff} | {stale if n != 'ddp' else ''} | {waits:.0f} | {len(rs)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    seed = rows[0]["seed"]
    for r in rows:
        if r["seed"] != seed:
            continue
        t, loss = smooth(r["logs"], window)
        ax.plot(t, loss, label=r["variant"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"training loss (mean of last {window} worker steps)")
    ax.set_yscale("log")
    ax.set_title(f"digits CNN, 1 server + 3 workers (MPI), one worker 2x slower; seed {seed}")
    ax.legend()
    names = list(dict.fromkeys(r["variant"] for r in rows))
    rate = [mean(r["samples_per_s"] for r in rows if r["variant"] == n) for n in names]
    acc = [mean(r["accuracy"] for r in rows if r["variant"] == n) for n in names]
    bars = bx.bar(names, rate, color="tab:blue")
    bx.set_ylabel("samples/s (all workers)")
    for bar, a in zip(bars, acc, strict=True):
        bx.annotate(
            f"{a:.1f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    bx.set_title("throughput (bars) and held-out accuracy (labels)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", default="0", help="comma-separated initial-weight / data-order seeds")
    ap.add_argument(
        "--variants", default="ddp,0,2,4,8,none", help="comma-separated: ddp and staleness values (none)"
    )
    ap.add_argument(
        "--delay-ms", type=float, default=None, help="slow worker's delay (default: a compute step)"
    )
    ap.add_argument("--window", type=int, default=60, help="worker steps per point of the loss curve")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (with the loss logs) here")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    args = ap.parse_args()
    variants: list[str | int | None] = []
    for v in args.variants.split(","):
        v = v.strip().lower()
        if v not in ("ddp", "none") and not v.isdigit():
            ap.error(f"unknown variant {v!r}: use ddp, none or a staleness >= 0")
        variants.append(v if v == "ddp" else None if v == "none" else int(v))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    from dtlab.testing import spawn_world

    out = spawn_world(
        4, bench_world, variants, seeds, args.epochs, args.delay_ms, backend="mpi", timeout=3600
    )[0]
    print(table(out["rows"], out["delay_s"]))
    if args.json is not None:
        args.json.write_text(json.dumps(out))
    if args.plot is not None:
        plot(out["rows"], args.window, args.plot)


if __name__ == "__main__":
    main()
