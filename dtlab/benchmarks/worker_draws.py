"""What seeding each sample's draws in ``DataLoader`` workers costs (``dtlab train``'s loader with
``data.num_workers > 0``, :mod:`dtlab.trainers.worker_draws`): one epoch of small samples through torch's
``DataLoader`` as given and through dtlab's seeded fetch, alternately in the same run; prints the
fastest epoch of each as milliseconds a batch. Small samples show the cost at its largest (a sample
that decodes an image or tokenizes text takes far longer than its seeding).
Run::

    python -m dtlab.benchmarks.worker_draws --samples 65536 --batch 512 --workers 2

``--workers 0`` times what an in-memory rank does without workers instead (``ThreadFetch``: each
micro-batch under the process-wide lock, each sample seeded, the generators' states put back after).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from dtlab.data import DistributedSampler
from dtlab.trainers.worker_draws import PlacedSampler, SeededFetch, ThreadFetch


class _Small(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), i)


def _ms_per_batch(loader: DataLoader[torch.Tensor]) -> float:
    start = time.perf_counter()
    batches = sum(1 for _ in loader)
    return (time.perf_counter() - start) / max(batches, 1) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    data = _Small(args.samples)
    sampler = DistributedSampler(data, 1, 0, seed=0)
    plain = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    fetch = ThreadFetch(data) if args.workers == 0 else SeededFetch(data)  # 0: an in-memory rank's
    seeded = DataLoader(fetch, args.batch, sampler=PlacedSampler(sampler), num_workers=args.workers)
    best = {"plain": float("inf"), "seeded": float("inf")}
    for _ in range(args.rounds):
        best["plain"] = min(best["plain"], _ms_per_batch(plain))
        best["seeded"] = min(best["seeded"], _ms_per_batch(seeded))
    extra = (best["seeded"] - best["plain"]) / args.batch * 1e3
    print(
        f"{args.samples} samples, batch {args.batch}, {args.workers} workers: plain "
        f"{best['plain']:.2f} ms a batch, seeded {best['seeded']:.2f} ms "
        f"({best['seeded'] / best['plain']:.2f}x, +{extra:.1f} us a sample)"
    )


if __name__ == "__main__":
    main()
