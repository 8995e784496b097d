"""Host memory of resuming a sharded model: an FSDP model (``--layers`` square linear layers of
``--width``) with AdamW is trained one step and saved on ``--save-ranks`` in-memory ranks, then resumed
on each of ``--ranks`` in a fresh process each: every rank builds its model and optimizer (state
allocated by one step), then reads the checkpoint (rank 0 verifying every file, the others the files
they read, as the Trainer does) and loads it. A thread samples the process's resident memory every
2 ms from the moment every rank is built; the table gives its peak above the memory before the load,
the bytes of tensor data the ranks read from the checkpoint, and the checkpoint's size.
Run::

    python -m dtlab.benchmarks.resume_memory --ranks 1 2 4
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.core import seeded_init
from dtlab.models import FSDPModel
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.testing import run_world


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(backend: CommunicationBackend, width: int, layers: int) -> tuple[Any, Any]:
    with seeded_init(0):
        net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = FSDPModel(net, backend)
    opt = ZeRO3Optimizer(model, torch.optim.AdamW, lr=0.01)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(backend.rank))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save(backend: CommunicationBackend, root: str, width: int, layers: int) -> None:
    model, opt = _build(backend, width, layers)
    save_checkpoint(root, 1, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {}, {})


def _resume(backend: CommunicationBackend, root: str, width: int, layers: int, start: list[int]) -> int:
    model, opt = _build(backend, width, layers)
    gc.collect()
    backend.barrier()
    if backend.rank == 0:
        start.append(_rss())
    backend.barrier()
    ckpt = read_checkpoint(root, verify_all=backend.rank == 0)
    model.load_sharded_state_dict(ckpt.model)
    opt.load_sharded_state_dict(ckpt.optim)
    backend.barrier()
    return ckpt.reads.tensor_bytes


def _child(root: str, ranks: int, width: int, layers: int) -> None:
    """One resume on ``ranks`` ranks in this process; prints ``peak_above_start tensor_bytes``."""
    start: list[int] = []
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            if start:
                peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    read = run_world(ranks, _resume, root, width, layers, start, timeout=600)
    done.set()
    sampler.join()
    print(max(peak[0] - start[0], 0), sum(read))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="loading world sizes")
    p.add_argument("--save-ranks", type=int, default=4, help="the world size that saves")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.ranks[0], args.width, args.layers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run_world(args.save_ranks, _save, tmp, args.width, args.layers, timeout=600)
        step = Path(tmp) / "step_00000001"
        size = sum(f.stat().st_size for f in step.iterdir())
        print(f"checkpoint: {size / 1e6:.0f} MB (FSDP + AdamW, saved on {args.save_ranks} ranks)")
        print(f"{'ranks':>5}  {'peak above start':>16}  {'tensor data read (all ranks)':>28}")
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # freed buffers leave the process
        for n in args.ranks:
            cmd = [sys.executable, "-m", "dtlab.benchmarks.resume_memory", "--child", tmp, "--ranks", str(n)]
            cmd += ["--width", str(args.width), "--layers", str(args.layers)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
            print(f"{n:>5}  {int(out[-2]) / 1e6:>13.0f} MB  {int(out[-1]) / 1e6:>25.0f} MB")


if __name__ == "__main__":
    main()
