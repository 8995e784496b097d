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
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _model(args: dict[str, Any]) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=args["intermediate"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        max_position_embeddings=args["seq"],
        use_cache=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


def _data(args: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def _loss(output: Any, y: Any) -> Any:
    import torch.nn.functional as F

    logits = getattr(output, "logits", output)
    if isinstance(logits, tuple | list):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _split(args: dict[str, Any]) -> str:
    return f"model.layers.{args['layers'] // 2}"


def _dtlab_step(backend: Any, args: dict[str, Any]) -> Callable[[], float]:
    import torch

    from dtlab.models import PipelineParallelModel
    from dtlab.optimizers import DDPOptimizer

    model = PipelineParallelModel(
        _model(args), backend, "1f1b", micro_batches=args["micro_batches"], split_points=[_split(args)]
    )
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-4, foreach=False)
    x, y = _data(args)

    def step() -> float:
        loss = model.train_step((x, y), _loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def _torch_step(backend: Any, args: dict[str, Any]) -> Callable[[], float]:
    """torch's traced pipeline of the same model: ``pipeline()`` splits it at the same module,
    ``build_stage`` gives this rank's stage, ``Schedule1F1B`` runs it."""
    import torch
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from dtlab.backends import ReduceOp

    x, y = _data(args)
    m = args["micro_batches"]
    pipe = pipeline(_model(args), mb_args=(x.chunk(m)[0],), split_spec={_split(args): SplitPoint.BEGINNING})
    rank = torch.distributed.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = Schedule1F1B(stage, m, loss_fn=_loss)
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


def _timed(backend: Any, step: Callable[[], float]) -> float:
    import torch

    from dtlab.backends import ReduceOp

    backend.barrier()
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    backend.all_reduce(dt, ReduceOp.MAX)
    return float(dt.item())


def bench_world(backend: Any, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: both variants, alternating blocks; per-step times (the slowest rank's)."""
    import torch

    torch.set_num_threads(args["threads"])
    variants = {"dtlab": _dtlab_step(backend, args), "torch": _torch_step(backend, args)}
    first_loss = {name: step() for name, step in variants.items()}
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args["warmup"]):
        for step in variants.values():
            step()
    for r in range(args["rounds"]):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            times[name].extend(_timed(backend, variants[name]) for _ in range(args["steps"]))
    return {"times": times, "first_loss": first_loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=10, help="blocks per variant (alternating order)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ns = parser.parse_args(argv)
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "batch", "seq")
    args = {k: getattr(ns, k) for k in (*keys, "micro_batches", "steps", "rounds", "warmup", "threads")}

    from dtlab.testing import spawn_world

    res = spawn_world(2, bench_world, args, backend="gloo", timeout=3600, check_collectives=False)[0]
    med = {n: statistics.median(ts) for n, ts in res["times"].items()}
    k = ns.steps  # each round's blocks ran back to back: their ratio is robust to slow drifts in load
    paired = [
        statistics.median(res["times"]["dtlab"][i : i + k])
        / statistics.median(res["times"]["torch"][i : i + k])
        for i in range(0, len(res["times"]["torch"]), k)
    ]
    print("\npp=2 1F1B on gloo; " + ", ".join(f"{k}={v}" for k, v in args.items()) + "\n")
    print("| implementation | step, median (IQR) | ratio to torch (median) | first loss |")
    print("|---|---:|---:|---:|")
    for name, ts in res["times"].items():
        q = statistics.quantiles(ts, n=4)
        print(
            f"| {name} | {1e3 * med[name]:.0f} ms ({1e3 * q[0]:.0f}-{1e3 * q[2]:.0f}) | "
            f"{med[name] / med['torch']:.2f} | {res['first_loss'][name]:.6f} |"
        )
    q = statistics.quantiles(paired, n=4)
    print(
        f"\ndtlab / torch per round (block medians): median {statistics.median(paired):.2f} "
        f"(IQR {q[0]:.2f}-{q[2]:.2f}) over {len(paired)} rounds"
    )
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "raw": res}, indent=1, default=str))


if __name__ == "__main__":
    main()
