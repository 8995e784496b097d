"""Activation checkpointing: peak allocated memory and time of one forward + backward, with and
without, under DDP, ZeRO-3 and FSDP (the built-in transformer, one block per FSDP unit).

Memory is the CPU allocator's peak total above where the step started (torch.profiler's memory events;
the parameters and the batch exist before), measured on one in-memory rank so the profiler sees one
rank's allocations only. Time is the median of ``--repeats`` steps, taken without the profiler. Run::

    python -m dtlab.benchmarks.checkpointing
    python -m dtlab.benchmarks.checkpointing --d-model 256 --layers 8 --batch 16 --seq 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import DDPModel, FSDPModel, ModelStrategy, ModuleClassPolicy, ZeRO3Model
from dtlab.models.checkpointing import checkpoint_modules
from dtlab.testing import run_world
from dtlab.trainers.tasks import cross_entropy_loss
from dtlab.zoo import Block, TransformerLM


def peak_allocated(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's total allocated bytes while ``fn`` runs, above its start."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return int(max(e["args"]["Total Allocated"] for e in events) - start)


def _rank(backend: CommunicationBackend, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for strategy in ("ddp", "zero3", "fsdp"):
        for ckpt in (False, True):
            with seeded_init(0):
                net = TransformerLM(args.d_model, args.layers, max(1, args.d_model // 64), args.seq)
            if ckpt:
                checkpoint_modules(net, (Block,))
            if strategy == "ddp":
                model: ModelStrategy = DDPModel(net, backend)
            elif strategy == "zero3":
                model = ZeRO3Model(net, backend, persistence_threshold=0)
            else:
                model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)))

            def step(model: ModelStrategy = model) -> None:
                cross_entropy_loss(model(x), y).backward()
                model.zero_grad(set_to_none=True)

            step()  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            peak = peak_allocated(step)
            rows.append({"strategy": strategy, "checkpointing": ckpt, "peak_bytes": peak,
                         "step_ms": 1e3 * statistics.median(times)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = run_world(1, _rank, args, timeout=1800)[0]
    what = f"d_model={args.d_model}, {args.layers} blocks, batch {args.batch} x {args.seq} tokens"
    print(f"\nTransformerLM {what}\n")
    print("| strategy | checkpointing | peak allocated (MB) | vs off | step (ms) | vs off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        off = next(o for o in rows if o["strategy"] == r["strategy"] and not o["checkpointing"])
        on = "on" if r["checkpointing"] else "off"
        mem, ms = r["peak_bytes"], r["step_ms"]
        print(f"| {r['strategy']} | {on} | {mem / 1e6:.1f} | {mem / off['peak_bytes']:.2f}x | {ms:.0f} | "
              f"{ms / off['step_ms']:.2f}x |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
