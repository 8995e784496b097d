"""Tensor parallelism: step time and bytes per rank of dtlab's TensorParallelModel on the built-in
transformer at tp=2 on Gloo and MPI, and torch's DTensor tensor parallelism (``parallelize_module``
with ``ColwiseParallel``/``RowwiseParallel``, ``loss_parallel``) on Gloo in the same processes.

    .venv/bin/python -m dtlab.benchmarks.tensor                       # defaults below, Gloo and MPI
    .venv/bin/python -m dtlab.benchmarks.tensor --d-model 512 --layers 4 --batch 8 --seq 128 --steps 20

A step is forward, loss (vocabulary-parallel: the logits stay split), backward and an AdamW step on
one tp=2 group (no dp axis). Both implementations split the same layers the same way (heads and MLP,
the token embedding by vocabulary, the head by vocabulary) from the same initial weights, and their
first-step losses are printed side by side as a check. In the Gloo world the variants alternate in
blocks of ``--steps`` steps (``--rounds`` rounds, after ``--warmup`` steps each), each step timed as the
slowest rank's; the table shows the median step. dtlab's bytes per rank per step come from
``backend.stats``; torch's collectives and their bytes are counted with a dispatch mode
(``_torch_comm.TorchCollectives``, by dtlab's ring convention: torch has no byte counter). dtlab's
sequence-parallel variant runs as an extra row.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._paired import (
    TP_TRANSFORMER,
    add_timing_args,
    add_tp_transformer_args,
    alternate,
    plain_step,
    quartiles,
)

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    from torch.distributed.tensor.parallel import ParallelStyle

    from dtlab.backends.base import CommunicationBackend
    from dtlab.benchmarks._torch_comm import TorchCollectives


def transformer(args: dict[str, Any]) -> Any:  # Any: parallelize_transformer edits its blocks' attributes
    """The built-in ``TransformerLM`` of ``args``' sizes, its values normal(0, 0.02) from seed 0."""
    import torch

    from dtlab.trainers.models import TransformerLM

    gen = torch.Generator().manual_seed(0)
    net = TransformerLM(args["d_model"], args["layers"], args["heads"], args["seq"])
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return net


def tp_batch(args: dict[str, Any]) -> tuple[Any, Any]:
    """``args["batch"]`` sequences of ``args["seq"]`` tokens and their targets (seed 1)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    shape = (args["batch"], args["seq"])
    return torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen)


def _dtlab_step(
    backend: CommunicationBackend, args: dict[str, Any], sp: bool
) -> tuple[Callable[[], float], CommunicationBackend]:
    import torch

    from dtlab.backends import Mesh
    from dtlab.models import TensorParallelModel, transformer_plan
    from dtlab.optimizers import DDPOptimizer

    mesh = Mesh(backend, {"tp": backend.world_size})
    model = TensorParallelModel(transformer(args), mesh, plan=transformer_plan(sequence_parallel=sp))
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-4)
    x, y = tp_batch(args)
    return plain_step(lambda: model.cross_entropy(model(x), y), opt), mesh["tp"]


def qkv_order(d_model: int, tp: int) -> Any:
    """The rows of qkv (``[q, k, v]``, ``3 * d_model``) reordered ``[q_0, k_0, v_0, q_1, ...]`` per tp
    rank, so that a contiguous column split holds q, k and v of the same heads (dtlab's per-head split)."""
    import torch

    return torch.arange(3 * d_model).view(3, tp, d_model // tp).transpose(0, 1).reshape(-1)


def parallelize_transformer(net: Any, tp_mesh: Any) -> None:
    """torch's DTensor TP of ``transformer()``, as dtlab's ``transformer_plan()`` splits it, as
    torchtitan applies it (``parallelize_module`` per block, then on the root): ``ColwiseParallel`` on
    qkv (its rows reordered by :func:`qkv_order`, local head count set as dtlab does) and the MLP's first
    layer, ``RowwiseParallel`` on the attention and MLP output projections, the token embedding
    vocabulary-parallel, the head column-parallel with its logits left split (``loss_parallel``)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    order = qkv_order(net.tok.embedding_dim, tp)
    with torch.no_grad():
        for block in net.blocks:
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
            block.attn.n_heads //= tp
    block_plan: dict[str, ParallelStyle] = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in net.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    root_plan: dict[str, ParallelStyle] = {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(net, tp_mesh, root_plan)


def loss_parallel_backward(net: Any, x: Any, y: Any) -> Callable[[], float]:
    """Forward, cross entropy under ``loss_parallel()`` (the logits split over the vocabulary, a DTensor
    ``Shard(-1)``) and backward; the loss."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    def forward_backward() -> float:
        logits = net(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return forward_backward


def _torch_step(args: dict[str, Any]) -> tuple[Callable[[], float], Callable[[], TorchCollectives]]:
    """torch's DTensor TP on the same model (:func:`parallelize_transformer`) over the whole world."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtlab.benchmarks._torch_comm import TorchCollectives

    net = transformer(args)
    parallelize_transformer(net, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)
    forward_backward = loss_parallel_backward(net, *tp_batch(args))

    def step() -> float:
        loss = forward_backward()
        opt.step()
        opt.zero_grad()
        return loss

    def count() -> TorchCollectives:
        counter = TorchCollectives()
        with counter:
            step()
        return counter

    return step, count


def bench_world(backend: CommunicationBackend, args: dict[str, Any], with_torch: bool) -> dict[str, Any]:
    """One rank of one engine's world: every variant, alternating blocks; per-step times and bytes."""
    import torch

    torch.set_num_threads(args["threads"])
    variants: dict[str, Callable[[], float]] = {}
    first_loss: dict[str, float] = {}
    bytes_per_step: dict[str, Any] = {}
    for name, sp in (("dtlab", False), ("dtlab-sp", True)):
        step, group = _dtlab_step(backend, args, sp)
        first_loss[name] = step()
        group.stats.reset()
        step()
        bytes_per_step[name] = {"sent": group.stats.bytes_sent, "ops": group.stats.snapshot()}
        variants[name] = step
    if with_torch:
        tstep, count = _torch_step(args)
        first_loss["torch"] = tstep()
        counter = count()
        bytes_per_step["torch"] = {"sent": counter.bytes_sent, "collectives": counter.calls}
        variants["torch"] = tstep
    times = alternate(backend, variants, args["rounds"], args["steps"], args["warmup"])
    return {"times": times, "first_loss": first_loss, "bytes": bytes_per_step}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", default="gloo,mpi")
    add_tp_transformer_args(parser)
    add_timing_args(parser, steps=5, rounds=6)
    ns = parser.parse_args(argv)
    args = {k: getattr(ns, k) for k in (*TP_TRANSFORMER, "steps", "rounds", "warmup", "threads")}

    from dtlab.testing import spawn_world

    rows, raw = [], {}
    for engine in ns.engines.split(","):
        res = spawn_world(
            ns.tp, bench_world, args, engine == "gloo", backend=engine, timeout=1800, check_collectives=False
        )[0]
        raw[engine] = res
        for name, ts in res["times"].items():
            b = res["bytes"][name]
            rows.append(
                {
                    "engine": engine,
                    "variant": name,
                    "median_ms": 1e3 * statistics.median(ts),
                    "iqr_ms": [1e3 * q for q in quartiles(ts)],
                    "min_ms": 1e3 * min(ts),
                    "first_loss": res["first_loss"][name],
                    "bytes": b.get("sent"),
                    "comm": b.get("collectives") or {k: v["calls"] for k, v in b["ops"].items()},
                }
            )
    cfg = ", ".join(f"{k}={v}" for k, v in args.items())
    print(f"\ntp={ns.tp}; {cfg}\n")
    print(
        "| engine | implementation | step, median (IQR) | step, best | ratio to torch (median / best) "
        "| sent per rank per step | collectives per step | first loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = next((q for q in rows if q["engine"] == "gloo" and q["variant"] == "torch"), None)
    for r in rows:
        ratio = "-"
        if ref is not None:
            ratio = f"{r['median_ms'] / ref['median_ms']:.2f} / {r['min_ms'] / ref['min_ms']:.2f}"
        sent = "not counted" if r["bytes"] is None else f"{r['bytes'] / 2**20:.2f} MiB"
        comm = ", ".join(f"{k} {v}" for k, v in sorted(r["comm"].items()))
        lo, hi = r["iqr_ms"]
        print(
            f"| {r['engine']} | {r['variant']} | {r['median_ms']:.0f} ms ({lo:.0f}-{hi:.0f}) | "
            f"{r['min_ms']:.0f} ms | {ratio} | {sent} | {comm} | {r['first_loss']:.6f} |"
        )
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "rows": rows, "raw": raw}, indent=1, default=str))


if __name__ == "__main__":
    main()
