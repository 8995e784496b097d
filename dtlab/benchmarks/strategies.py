"""dtlab's data-parallel strategies against PyTorch's DistributedDataParallel and FSDP2 ``fully_shard``.

For a ~10M-parameter MLP and a small transformer, on 2 ranks (processes) over Gloo and over MPI:
step time (forward + backward + optimizer step, AdamW), bytes sent per rank per step (dtlab's
counters; torch's collectives are not counted), model-state memory per rank (parameters + gradients
+ optimizer state + peak gathered parameters, from the tensors) and the peak resident memory each
configuration added (Linux ``VmHWM`` over the RSS before building, measured in a fresh 2-process world
per configuration). Under Gloo the same processes also run torch DDP and torch FSDP2 on the same
process group. Results: docs/performance.md, "Strategies against torch DDP and FSDP2".

Configurations run interleaved, ``--rounds`` times, and each reports its median step time, so drift
in the machine's load hits every configuration alike. Run::

    python -m dtlab.benchmarks.strategies                 # both engines, both models
    python -m dtlab.benchmarks.strategies --engines gloo --models mlp --steps 5 --rounds 3
    python -m dtlab.benchmarks.strategies --engines gloo --strategies ddp,torch_ddp --skip-memory
    python -m dtlab.benchmarks.strategies --strategies ddp,zero1,zero1_allreduce --skip-memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.benchmarks._strategies_models import build
from dtlab.benchmarks._strategies_run import DTLAB, DTLAB_EXTRA, TORCH, Run

__all__ = ["main", "probe_memory", "suite"]


def probe_memory(backend: CommunicationBackend, model: str, strategy: str) -> dict[str, int]:
    """In a fresh world: build one configuration, run 3 steps, report its memory (peak RSS is only
    meaningful in a process that has not allocated and freed model-sized memory before)."""
    torch.set_num_threads(1)
    run = Run(backend, model, strategy)
    if strategy == "torch_fsdp2":
        run.watch_gathered()
    for _ in range(3):
        run.step(probe=True)
    return run.memory()


def suite(
    backend: CommunicationBackend,
    engine: str,
    models: list[str],
    steps: int,
    warmup: int,
    rounds: int,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Runs in every process of the world; returns this rank's rows."""
    torch.set_num_threads(1)
    strategies = list(DTLAB) + (list(TORCH) if engine == "gloo" else [])
    strategies = [s for s in strategies if only is None or s in only]
    strategies += [s for s in DTLAB_EXTRA if only is not None and s in only]
    rows = []
    for model in models:
        runs: dict[str, Run] = {}
        for s in strategies:
            run = Run(backend, model, s)
            for _ in range(warmup):
                run.step()
            runs[s] = run
        for _ in range(rounds):
            for s in strategies:
                runs[s].timed(steps)
        nparams = sum(p.numel() for p in build(model)[0].parameters())
        for s in strategies:
            times = torch.tensor([statistics.median(runs[s].times)], dtype=torch.float64)
            backend.all_reduce(times, ReduceOp.MAX)  # a step ends when the slowest rank ends it
            rows.append(
                {
                    "engine": engine,
                    "model": model,
                    "params": nparams,
                    "strategy": s,
                    "step_ms": float(times[0]) * 1e3,
                    "bytes_per_step": runs[s].bytes_per_step if s not in TORCH else None,
                    "grad_bytes": 4 * nparams,
                }
            )
        del runs
    return rows


# ---------------------------------------------------------------------------- report
def _fmt_mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| engine | model | strategy | step (ms) | sent/rank/step (MiB) | sent / grad bytes "
        "| model state/rank, peak in step (MiB) | peak RSS added/rank (MiB) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "n/a" if r["bytes_per_step"] is None else f"{r['bytes_per_step'] / r['grad_bytes']:.2f}"
        name = r["strategy"] if r["strategy"] in TORCH else f"dtlab {r['strategy']}"
        out.append(
            f"| {r['engine']} | {r['model']} ({r['params'] / 1e6:.2f}M) | {name} | {r['step_ms']:.1f} | "
            f"{_fmt_mb(r['bytes_per_step'])} | {ratio} | {_fmt_mb(r['model_state'])} | "
            f"{_fmt_mb(r['peak_rss_delta'])} |"
        )
    out += ["", *MEMORY_NOTES]
    return "\n".join(out)


#: how the memory columns are measured (printed under the table)
MEMORY_NOTES = [
    "- model state/rank, peak in step: parameters + gradients + optimizer state, read for every row at the "
    "same two moments of a step (after backward, and after the optimizer step, both before zero_grad; "
    "the larger), plus the step's peak of gathered parameters for ZeRO-3, FSDP and FSDP2 (they exist only "
    "inside forward/backward; measured: dtlab's counter at every gather, FSDP2's unsharded parameters at "
    "every module's forward and backward hooks, a prefetched unit not yet swapped in unseen); torch DDP "
    "counts its gradient buckets",
    "- peak RSS added/rank: the process's peak resident memory (VmHWM) over its RSS before building, in a "
    "fresh world per row, over the build and 3 steps",
]


def ratios(rows: list[dict[str, Any]]) -> str:
    def t(engine: str, model: str, strategy: str) -> float | None:
        for r in rows:
            if (r["engine"], r["model"], r["strategy"]) == (engine, model, strategy):
                return float(r["step_ms"])
        return None

    lines = []
    for model in sorted({r["model"] for r in rows}):
        checks = [
            (
                "dtlab DDP (gloo) / torch DDP (gloo)",
                t("gloo", model, "ddp"),
                t("gloo", model, "torch_ddp"),
                1.05,
            ),
            (
                "dtlab FSDP (gloo) / torch FSDP2 (gloo)",
                t("gloo", model, "fsdp"),
                t("gloo", model, "torch_fsdp2"),
                1.0,
            ),
            (
                "dtlab DDP (MPI) / torch DDP (gloo)",
                t("mpi", model, "ddp"),
                t("gloo", model, "torch_ddp"),
                1.0,
            ),
        ]
        for label, a, b, goal in checks:
            if a is not None and b is not None:
                verdict = "met" if a / b <= goal else "NOT met"
                lines.append(f"- {model}: {label} = {a / b:.3f} (goal <= {goal}: {verdict})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="gloo,mpi", help="comma-separated: gloo, mpi")
    ap.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp, transformer")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (median reported)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--strategies", default=None, help="comma-separated subset, e.g. ddp,torch_ddp")
    ap.add_argument("--skip-memory", action="store_true", help="no per-configuration memory probes")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    from dtlab.testing import spawn_world

    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in ("mlp", "transformer")]
    if bad:
        ap.error(f"unknown models {bad}; choose from mlp, transformer")
    known = [*DTLAB, *DTLAB_EXTRA, *TORCH]
    unknown = [s for s in (args.strategies or "").split(",") if s and s not in known]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {', '.join(known)}")
    rows: list[dict[str, Any]] = []
    for engine in [e for e in args.engines.split(",") if e]:
        if engine not in ("gloo", "mpi"):
            ap.error(f"unknown engine {engine!r}; choose gloo or mpi")
        result = spawn_world(
            args.world_size,
            suite,
            engine,
            models,
            args.steps,
            args.warmup,
            args.rounds,
            args.strategies.split(",") if args.strategies else None,
            backend=engine,
            timeout=3000,
            check_collectives=False,
        )
        for row in result[0]:
            if args.skip_memory:
                row["model_state"] = row["peak_rss_delta"] = None
                rows.append(row)
                continue
            mem = spawn_world(
                args.world_size,
                probe_memory,
                row["model"],
                row["strategy"],
                backend=engine,
                timeout=600,
                check_collectives=False,
            )
            row["model_state"] = max(m["model_state"] for m in mem)
            row["peak_rss_delta"] = max(m["peak_rss_delta"] for m in mem)
            rows.append(row)
        print(f"[{engine} done]", file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(ratios(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
