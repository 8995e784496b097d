"""Compare every data-parallel strategy (and Ok-Topk compression) through the Trainer's own metrics:
the byte-level transformer for a few steps on 4 in-memory ranks, one row per strategy with tokens/s,
communication share, bytes sent per rank per step and memory per rank, all measured.

Run: ``python examples/benchmark.py`` (about a minute on 2 CPU cores). For the real engines (Gloo, MPI)
against torch DDP/FSDP2 and the compression algorithms, run ``dtlab bench`` (table + PNG plots).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from dtlab.config import load_config
from dtlab.trainers import run_training

STEPS = 12
COMMON = [
    "backend.name=inmemory",
    "model.d_model=128",
    "data.max_bytes=200000",
    "data.global_batch_size=32",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    f"logging.log_every={STEPS}",
    "logging.progress=false",
    "strategy.persistence_threshold=0",
]
RUNS = {
    "ddp": ["strategy.model=ddp"],
    "zero1": ["strategy.model=zero1"],
    "zero2": ["strategy.model=zero2"],
    "zero3": ["strategy.model=zero3"],
    "fsdp": ["strategy.model=fsdp"],
    "ddp + oktopk 1%": ["strategy.model=ddp", "compression.algorithm=oktopk", "compression.density=0.01",
                        "compression.dense_warmup_steps=2"],
}  # fmt: skip


def main(argv: list[str]) -> None:
    print(f"{'strategy':<18}{'tokens/s':>10}{'comm %':>8}{'MB sent/rank/step':>19}{'param MB':>10}"
          f"{'grad MB':>9}{'optim MB':>10}{'loss':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            run_dir = Path(tmp) / name.replace(" ", "_")
            cfg = load_config(overrides=[*COMMON, *extra, f"logging.run_dir={run_dir}", *argv])
            run_training(cfg)
            rec = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
            mem = rec["memory_per_rank"][0]
            optim = mem.get("optimizer_state", 0) / 1e6
            print(
                f"{name:<18}{rec['tokens_per_s']:>10,.0f}{100 * rec['comm_s'] / rec['step_time_s']:>8.1f}"
                f"{max(rec['bytes_sent_per_rank']) / 1e6 / STEPS:>19.2f}{mem['parameters'] / 1e6:>10.2f}"
                f"{mem['gradients'] / 1e6:>9.2f}{optim:>10.2f}{rec['loss']:>8.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
