"""Gradient compression with Ok-Topk: the digits CNN on 4 in-memory ranks, each step sending about
``density`` of the gradient values, next to the dense baseline on the same data and seed.

Run: ``python examples/train_oktopk.py`` (extra ``key=value`` arguments override both runs, e.g.
``compression.density=0.02`` or ``strategy.model=zero2``). About a minute on 2 CPU cores.
"""

from __future__ import annotations

import sys

from dtlab.config import load_config
from dtlab.trainers import run_training

BASE = [
    "model.name=digits_cnn",
    "data.dataset=digits",
    "data.global_batch_size=64",
    "data.eval_fraction=0.2",
    "optimizer.lr=0.003",
    "optimizer.warmup_steps=5",
    "train.steps=150",
    "train.eval_every=150",
    "train.eval_batches=8",
    "logging.progress=false",
]


def run(extra: list[str]) -> tuple[float, float, float]:
    result = run_training(load_config(overrides=BASE + extra))[0]
    ev = result.evals[-1][1]
    mb = float(result.summary["sent MB/rank (largest rank)"])
    return ev["eval_loss"], ev["eval_accuracy"], mb


def main(argv: list[str]) -> None:
    rows = {
        "dense (no compression)": run(["logging.run_dir=runs/train_oktopk/dense", *argv]),
        "Ok-Topk density 0.05": run(
            [
                "compression.algorithm=oktopk",
                "compression.density=0.05",
                "compression.dense_warmup_steps=10",
                "logging.run_dir=runs/train_oktopk/oktopk",
                *argv,
            ]
        ),
    }
    print(f"{'run':<26}{'eval loss':>10}{'accuracy':>10}{'MB sent/rank':>14}")
    for name, (loss, acc, mb) in rows.items():
        print(f"{name:<26}{loss:>10.4f}{acc:>10.1%}{mb:>14.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
