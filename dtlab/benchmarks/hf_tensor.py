"""Tensor parallelism on a Hugging Face model: step time of dtlab's ``TensorParallelModel(plan="auto")``
on a ``LlamaForCausalLM`` (built from a config, no weights downloaded) at tp=2 on Gloo, against torch's
``parallelize_module`` with the same plan (the model's own ``_tp_plan``, each Hugging Face style as
torch's ``ColwiseParallel`` / ``RowwiseParallel``) in the same processes.

    .venv/bin/python -m dtlab.benchmarks.hf_tensor                 # defaults below
    .venv/bin/python -m dtlab.benchmarks.hf_tensor --hidden 512 --layers 4 --rounds 12 --steps 3

A step is forward, cross-entropy of the gathered logits (both plans gather the head's output, as
Hugging Face's ``colwise_gather_output`` says), backward and an AdamW step on one tp=2 group. Both start
from the same weights; their first-step losses are printed side by side as a check. The two variants
alternate in blocks of ``--steps`` steps (``--rounds`` rounds, the order reversed every other round,
after ``--warmup`` steps each); each step is timed as the slowest rank's and the table shows the median
step (and the interquartile range), the ratio of medians, and the median of the per-round ratios of
the two blocks' medians (robust to slow drifts in machine load). ``--profile`` also prints each variant's
top operators by self CPU time on rank 0 (torch.profiler, one block of steps).
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
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


def _data(args: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def _loss(logits: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _dtlab_step(backend: Any, args: dict[str, Any]) -> Callable[[], float]:
    import torch

    from dtlab.models import TensorParallelModel
    from dtlab.optimizers import DDPOptimizer

    model = TensorParallelModel(_model(args), backend, plan="auto")
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-4, foreach=False)
    x, y = _data(args)

    def step() -> float:
        loss = _loss(model(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


#: Hugging Face's style names as torch's styles (the ones Llama's plan uses)
def _torch_style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }
    return styles[name]


def _torch_step(args: dict[str, Any]) -> Callable[[], float]:
    """torch's DTensor tensor parallelism on the same model with the same plan (its patterns expanded
    to module names, as ``parallelize_module`` matches one part per name)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from dtlab.models.tensor import hugging_face_plan

    net = _model(args)
    declared = hugging_face_plan(net) or {}
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(net, mesh, {k: _torch_style(str(v)) for k, v in declared.items()})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)
    x, y = _data(args)

    def step() -> float:
        loss = _loss(net(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

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


def _profile(step: Callable[[], float], steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return table


def bench_world(backend: Any, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: both variants, alternating blocks; per-step times (the slowest rank's)."""
    import torch

    torch.set_num_threads(args["threads"])
    variants = {"dtlab": _dtlab_step(backend, args), "torch": _torch_step(args)}
    first_loss = {name: step() for name, step in variants.items()}
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args["warmup"]):
        for step in variants.values():
            step()
    for r in range(args["rounds"]):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            times[name].extend(_timed(backend, variants[name]) for _ in range(args["steps"]))
    profiles = {n: _profile(s, args["steps"]) for n, s in variants.items()} if args["profile"] else {}
    return {"times": times, "first_loss": first_loss, "profiles": profiles}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=10, help="blocks per variant (alternating order)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--profile", action="store_true", help="print each variant's top operators")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ns = parser.parse_args(argv)
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "batch", "seq", "steps")
    args = {k: getattr(ns, k) for k in (*keys, "rounds", "warmup", "threads", "profile")}

    from dtlab.testing import spawn_world

    res = spawn_world(ns.tp, bench_world, args, backend="gloo", timeout=3600, check_collectives=False)[0]
    med = {n: statistics.median(ts) for n, ts in res["times"].items()}
    k = ns.steps  # each round's blocks ran back to back: their ratio is robust to slow drifts in load
    paired = [
        statistics.median(res["times"]["dtlab"][i : i + k])
        / statistics.median(res["times"]["torch"][i : i + k])
        for i in range(0, len(res["times"]["torch"]), k)
    ]
    print(f"\ntp={ns.tp} on gloo; " + ", ".join(f"{k}={v}" for k, v in args.items()) + "\n")
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
    for name, table in res["profiles"].items():
        print(f"\n{name}: top operators by self CPU time, rank 0, {ns.steps} steps\n{table}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "raw": res}, indent=1, default=str))


if __name__ == "__main__":
    main()
