"""DDP on 4 in-memory ranks: a small CNN on scikit-learn's handwritten digits (no download).

Run: ``python examples/train_ddp.py`` (extra ``key=value`` arguments override the config, e.g.
``python examples/train_ddp.py strategy.model=zero2 backend.world_size=2``). About 20 s on 2 CPU cores.
The same script runs on processes: ``torchrun --nproc-per-node 2 examples/train_ddp.py``.
"""

from __future__ import annotations

import sys

from dtlab.config import load_config
from dtlab.trainers import run_training

OVERRIDES = [
    "model.name=digits_cnn",
    "data.dataset=digits",
    "data.global_batch_size=64",
    "data.eval_fraction=0.2",
    "strategy.model=ddp",
    "optimizer.lr=0.003",
    "optimizer.warmup_steps=5",
    "train.steps=150",
    "train.eval_every=50",
    "train.eval_batches=8",
    "logging.run_dir=runs/train_ddp",
    "logging.log_every=25",
]


def main(argv: list[str]) -> None:
    config = load_config(overrides=OVERRIDES + argv)
    result = run_training(config)[0]
    if result.rank == 0:
        first, last = result.losses[0][1], result.losses[-1][1]
        acc = result.evals[-1][1]["eval_accuracy"]
        # the strategy and world that ran (an override or a launcher may change both)
        where = f"{result.summary['strategy']} on {result.summary['backend']}"
        print(f"{where}: loss {first:.3f} -> {last:.3f}, held-out accuracy {acc:.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
