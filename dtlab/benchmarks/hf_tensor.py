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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._hf_llama import LLAMA_KEYS, add_llama_args, llama, lm_loss, token_batch
from dtlab.benchmarks._paired import add_timing_args, measure, plain_step, print_against_torch, profile_table

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    from torch.distributed.tensor.parallel import ParallelStyle

    from dtlab.backends.base import CommunicationBackend


def _dtlab_step(backend: CommunicationBackend, args: dict[str, Any]) -> Callable[[], float]:
    import torch

    from dtlab.models import TensorParallelModel
    from dtlab.optimizers import DDPOptimizer

    model = TensorParallelModel(llama(args), backend, plan="auto")
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-4, foreach=False)
    x, y = token_batch(args)
    return plain_step(lambda: lm_loss(model(x), y), opt)


#: Hugging Face's style names as torch's styles (the ones Llama's plan uses)
def _torch_style(name: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }
    return styles[name]


def parallelize_llama(net: Any, tp_mesh: Any) -> None:
    """torch's DTensor tensor parallelism of ``net`` over ``tp_mesh`` with the model's own plan (its
    patterns expanded to module names, as ``parallelize_module`` matches one part per name), each
    Hugging Face style as torch's (:func:`_torch_style`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from dtlab.models.tensor import hugging_face_plan

    declared = hugging_face_plan(net) or {}
    parallelize_module(net, tp_mesh, {k: _torch_style(str(v)) for k, v in declared.items()})


def _torch_step(args: dict[str, Any]) -> Callable[[], float]:
    """torch's DTensor tensor parallelism on the same model with the same plan (:func:`parallelize_llama`)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    net = llama(args)
    parallelize_llama(
        net, init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)
    x, y = token_batch(args)
    return plain_step(lambda: lm_loss(net(x), y), opt)


def bench_world(backend: CommunicationBackend, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: both variants, alternating blocks; per-step times (the slowest rank's)."""
    import torch

    torch.set_num_threads(args["threads"])
    variants = {"dtlab": _dtlab_step(backend, args), "torch": _torch_step(args)}
    res = measure(backend, variants, args)
    res["profiles"] = (
        {n: profile_table(s, args["steps"]) for n, s in variants.items()} if args["profile"] else {}
    )
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    add_llama_args(parser, layers=2)
    add_timing_args(parser, steps=3, rounds=10)
    parser.add_argument("--profile", action="store_true", help="print each variant's top operators")
    ns = parser.parse_args(argv)
    args = {k: getattr(ns, k) for k in (*LLAMA_KEYS, "steps", "rounds", "warmup", "threads", "profile")}

    from dtlab.testing import spawn_world

    res = spawn_world(ns.tp, bench_world, args, backend="gloo", timeout=3600, check_collectives=False)[0]
    print_against_torch(
        f"tp={ns.tp} on gloo; " + ", ".join(f"{k}={v}" for k, v in args.items()), res, ns.steps
    )
    for name, table in res["profiles"].items():
        print(f"\n{name}: top operators by self CPU time, rank 0, {ns.steps} steps\n{table}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "raw": res}, indent=1, default=str))


if __name__ == "__main__":
    main()
