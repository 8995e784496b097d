"""Pipeline parallelism on a Hugging Face model: step time of dtlab's
``PipelineParallelModel(split_points=["model.layers.N/2"])`` on a ``LlamaForCausalLM`` (built from a
config, no weights downloaded) at pp=2 under 1F1B on Gloo, against torch's traced
``pipeline(model, split_spec={"model.layers.N/2": SplitPoint.BEGINNING})`` + ``Schedule1F1B`` in the same
processes.

    .venv/bin/python -m dtlab.benchmarks.hf_pipeline                 # defaults below
    .venv/bin/python -m dtlab.benchmarks.hf_pipeline --hidden 512 --layers 8 --rounds 12 --steps 3

A step is the schedule's forwards and backwards of ``--micro-batches`` micro-batches (cross-entropy of
the logits on the last stage) and an AdamW step of each stage. Both start from the same weights; their
first-step losses are printed side by side as a check. The two variants alternate in blocks of
``--steps`` steps (``--rounds`` rounds, the order reversed every other round, after ``--warmup`` steps
each); each step is timed as the slowest rank's; the table shows the median step (and the interquartile
range), the ratio of medians, and the median of the per-round ratios of the two blocks' medians.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._hf_llama import LLAMA_KEYS, add_llama_args, llama, lm_loss, token_batch
from dtlab.benchmarks._paired import add_timing_args, measure, print_against_torch

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    from dtlab.backends.base import CommunicationBackend


def _split(args: dict[str, Any]) -> str:
    return f"model.layers.{args['layers'] // 2}"


def _dtlab_step(backend: CommunicationBackend, args: dict[str, Any]) -> Callable[[], float]:
    import torch

    from dtlab.models import PipelineParallelModel
    from dtlab.optimizers import DDPOptimizer

    model = PipelineParallelModel(
        llama(args, use_cache=False),
        backend,
        "1f1b",
        micro_batches=args["micro_batches"],
        split_points=[_split(args)],
    )
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-4, foreach=False)
    x, y = token_batch(args)

    def step() -> float:
        loss = model.train_step((x, y), lm_loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def _torch_step(backend: CommunicationBackend, args: dict[str, Any]) -> Callable[[], float]:
    """torch's traced pipeline of the same model: ``pipeline()`` splits it at the same module,
    ``build_stage`` gives this rank's stage, ``Schedule1F1B`` runs it."""
    import torch
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from dtlab.backends import ReduceOp

    x, y = token_batch(args)
    m = args["micro_batches"]
    pipe = pipeline(
        llama(args, use_cache=False),
        mb_args=(x.chunk(m)[0],),
        split_spec={_split(args): SplitPoint.BEGINNING},
    )
    rank = torch.distributed.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-4, foreach=False)
    first, last = rank == 0, rank == torch.distributed.get_world_size() - 1

    def step() -> float:
        losses: list[Any] = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([float(sum(losses)) / m if last else 0.0], dtype=torch.float64)
        backend.all_reduce(total, ReduceOp.SUM)  # the loss on every rank, as dtlab's train_step returns it
        return float(total.item())

    return step


def bench_world(backend: CommunicationBackend, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: both variants, alternating blocks; per-step times (the slowest rank's)."""
    import torch

    torch.set_num_threads(args["threads"])
    variants = {"dtlab": _dtlab_step(backend, args), "torch": _torch_step(backend, args)}
    return measure(backend, variants, args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_args(parser, layers=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    add_timing_args(parser, steps=3, rounds=10)
    ns = parser.parse_args(argv)
    args = {k: getattr(ns, k) for k in (*LLAMA_KEYS, "micro_batches", "steps", "rounds", "warmup", "threads")}

    from dtlab.testing import spawn_world

    res = spawn_world(2, bench_world, args, backend="gloo", timeout=3600, check_collectives=False)[0]
    title = "pp=2 1F1B on gloo; " + ", ".join(f"{k}={v}" for k, v in args.items())
    print_against_torch(title, res, ns.steps)
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "raw": res}, indent=1, default=str))


if __name__ == "__main__":
    main()
