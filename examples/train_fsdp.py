"""FSDP on 4 in-memory ranks: the byte-level transformer (one unit per block) on the Python standard
library's source; then the sharded checkpoint is loaded on 2 ranks under DDP (resharding across world
size and strategy) and consolidated into one safetensors file.

Run: ``python examples/train_fsdp.py``. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import sys

import torch

from dtlab.checkpoint import consolidate
from dtlab.config import load_config
from dtlab.testing import run_world
from dtlab.trainers import Trainer, run_training

COMMON = [
    "model.d_model=96",
    "model.n_heads=4",
    "data.max_bytes=300000",
    "data.global_batch_size=16",
    "optimizer.lr=0.003",
    "train.steps=60",
    "train.eval_every=30",
    "checkpoint.dir=runs/train_fsdp/ckpt",
    "logging.run_dir=runs/train_fsdp",
    "logging.log_every=20",
]


def _full_state(backend, config):  # type: ignore[no-untyped-def]
    trainer = Trainer(config, backend)  # resumes from the checkpoint at construction
    return trainer.model.full_state_dict(), trainer.evaluate()


def main(argv: list[str]) -> None:
    config = load_config(overrides=[*COMMON, "strategy.model=fsdp", "backend.world_size=4", *argv])
    result = run_training(config)[0]
    print(
        f"FSDP x 4: loss {result.losses[0][1]:.3f} -> {result.losses[-1][1]:.3f}; saved {result.checkpoint}"
    )

    ddp2 = load_config(
        overrides=[*COMMON, "strategy.model=ddp", "backend.world_size=2", "checkpoint.resume=true", *argv]
    )
    state, ev = run_world(2, _full_state, ddp2)[0]
    print(
        f"loaded on DDP x 2: eval loss {ev['eval_loss']:.4f} "
        f"(FSDP x 4 ended at {result.evals[-1][1]['eval_loss']:.4f})"
    )

    out = consolidate("runs/train_fsdp/ckpt", "runs/train_fsdp/model.safetensors")
    from safetensors.torch import load_file

    full = load_file(str(out))
    same = all(torch.equal(full[k], v) for k, v in state.items())
    print(f"consolidated {len(full)} tensors into {out}; identical to the DDP x 2 model: {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
