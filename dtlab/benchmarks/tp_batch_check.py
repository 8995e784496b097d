"""What the tensor-parallel batch check costs: every rank of a tp group checks that it was given the
same batch (one all-reduce of a 3-integer fingerprint per forward, loss or train_step; the fingerprint
reads every input bit once). Step time with ``tp_batch_check="always"`` (the default) and ``"never"``,
in the same processes, on the built-in transformer at tp=2 (Gloo by default):

    .venv/bin/python -m dtlab.benchmarks.tp_batch_check
    .venv/bin/python -m dtlab.benchmarks.tp_batch_check --d-model 512 --batch 8 --seq 256 --engine mpi

Variants, alternating in blocks (``dtlab.benchmarks._paired``; each step timed as the slowest rank's):
``always``: ``model.cross_entropy(model(x), y)`` (two checks: the inputs, the targets), backward,
AdamW step; ``never``: the same on a second model, equal to the first, built with
``tp_batch_check="never"`` (its own optimizer; ``"first"`` is this after its first step);
``check``: one check of ``(x, y)`` alone; ``check, images``: one check of an image batch
(``--images`` x 3 x 224 x 224 fp32), to show the cost of reading large inputs. Also the tp group's
collectives (calls, bytes) in the first two steps under each choice. With ``--generate N``: Hugging
Face's ``model.module.generate`` of N tokens (greedy, ``--batch`` prompts of 6 tokens) on a
``LlamaForCausalLM`` of the same width, layers and heads (vocabulary 256), built with each choice
(``generate, always`` / ``generate, never``): every decoding forward is one check.

    .venv/bin/python -m dtlab.benchmarks.tp_batch_check --engine inmemory --d-model 16 --heads 2 \
        --batch 2 --generate 32
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
    round_ratios,
)

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    from dtlab.backends.base import CommunicationBackend
    from dtlab.core.plan import TpBatchCheckWhen

CHOICES: tuple[TpBatchCheckWhen, ...] = ("always", "first", "never")  # each a model's tp_batch_check


def bench_world(backend: CommunicationBackend, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: the variants in alternating blocks, their step times; the tp group's collectives in
    the first two steps of a model built with each ``tp_batch_check``."""
    import copy

    import torch

    from dtlab.backends import Mesh
    from dtlab.models import TensorParallelModel, transformer_plan
    from dtlab.models.tensor._agree import check_same_on_tp
    from dtlab.optimizers import DDPOptimizer
    from dtlab.zoo import TransformerLM

    torch.set_num_threads(args["threads"])
    mesh = Mesh(backend, {"tp": backend.world_size})
    tp, ranks = mesh["tp"], mesh.ranks("tp")
    gen = torch.Generator().manual_seed(0)
    net = TransformerLM(args["d_model"], args["layers"], args["heads"], args["seq"])
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    plan = transformer_plan()
    models = {c: TensorParallelModel(copy.deepcopy(net), mesh, plan=plan, tp_batch_check=c) for c in CHOICES}
    shape = (args["batch"], args["seq"])
    x, y = torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen)
    images = torch.randn(args["images"], 3, 224, 224, generator=gen)

    def check(named: list[tuple[str, Any]]) -> float:
        check_same_on_tp("bench", "inputs", named, tp, ranks)
        return 0.0

    def step_of(m: TensorParallelModel) -> Callable[[], float]:
        return plain_step(lambda: m.cross_entropy(m(x), y), DDPOptimizer(m, torch.optim.AdamW, lr=1e-4))

    steps = {c: step_of(m) for c, m in models.items()}
    collectives: dict[str, list[tuple[int, int]]] = {c: [] for c in CHOICES}
    for c, step in steps.items():  # the tp group's collectives in each of the first two steps
        for _ in range(2):
            calls, sent = tp.stats.calls, tp.stats.bytes_sent
            step()
            collectives[c].append((tp.stats.calls - calls, tp.stats.bytes_sent - sent))
    variants = {
        "always": steps["always"],
        "never": steps["never"],
        "check": lambda: check([("x", x), ("y", y)]),
        "check, images": lambda: check([("images", images)]),
    }
    if args["generate"]:
        variants |= generate_variants(mesh, args)
    times = alternate(backend, variants, args["rounds"], args["steps"], args["warmup"])
    return {"times": times, "collectives": collectives}


def generate_variants(mesh: Any, args: dict[str, Any]) -> dict[str, Callable[[], float]]:
    """``generate, always`` and ``generate, never``: one greedy ``generate`` of ``args["generate"]``
    tokens through ``model.module`` of a Hugging Face Llama at tensor parallelism, built with each."""
    import torch

    from dtlab.benchmarks._hf_llama import llama
    from dtlab.models import TensorParallelModel

    n, hidden, heads = args["generate"], args["d_model"], args["heads"]
    sizes = {"vocab": 256, "hidden": hidden, "intermediate": 2 * hidden, "layers": args["layers"]}
    net = llama(sizes | {"heads": heads, "seq": 6 + n})
    prompts = torch.arange(6 * args["batch"]).reshape(args["batch"], 6) % 256

    def step_of(check: TpBatchCheckWhen) -> Callable[[], float]:
        import copy

        model = TensorParallelModel(copy.deepcopy(net), mesh, plan="auto", tp_batch_check=check).eval()
        hf: Any = model.module  # the Hugging Face model, split in place

        def step() -> float:
            with torch.no_grad():
                hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return 0.0

        return step

    return {f"generate, {c}": step_of(c) for c in ("always", "never")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="gloo", choices=("gloo", "mpi", "inmemory"))
    add_tp_transformer_args(parser)
    parser.add_argument("--images", type=int, default=32, help="images in the image batch checked alone")
    parser.add_argument(
        "--generate", type=int, default=0, help="also time a Hugging Face generate of this many tokens"
    )
    add_timing_args(parser, steps=5, rounds=8)
    ns = parser.parse_args(argv)
    keys = (*TP_TRANSFORMER, "images", "generate", "steps", "rounds", "warmup", "threads")
    args = {k: getattr(ns, k) for k in keys}

    from dtlab.testing import run_world, spawn_world

    if ns.generate:  # transformers' lazy import resolved once here, not by the in-memory ranks at once
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    if ns.engine == "inmemory":
        res = run_world(ns.tp, bench_world, args, timeout=1800)[0]
    else:
        res = spawn_world(ns.tp, bench_world, args, backend=ns.engine, timeout=1800, check_collectives=False)[
            0
        ]
    times: dict[str, list[float]] = res["times"]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    print(f"\n{ns.engine}, tp={ns.tp}; " + ", ".join(f"{k}={v}" for k, v in args.items()) + "\n")
    print('| variant | median (IQR) | against a step with tp_batch_check="never" (medians) |')
    print("|---|---:|---:|")
    for name, ts in times.items():
        lo, hi = quartiles(ts)
        vs = {"always": f"{med[name] / med['never']:.3f}x", "never": "1"}.get(
            name, f"{100 * med[name] / med['never']:.2f}% of it"
        )
        if name.startswith("generate"):
            vs = f"{med[name] / med['generate, never']:.3f}x a generate with never"
        print(f"| {name} | {1e3 * med[name]:.2f} ms ({1e3 * lo:.2f}-{1e3 * hi:.2f}) | {vs} |")
    print("\n| tp_batch_check | collectives over tp, step 1 (calls, bytes sent) | step 2 |\n|---|---:|---:|")
    for choice, (one, two) in res["collectives"].items():
        print(f"| {choice} | {one[0]}, {one[1]:,} | {two[0]}, {two[1]:,} |")
    paired = round_ratios(times["always"], times["never"], args["steps"])
    lo, hi = quartiles(paired)
    print(
        f"\nalways / never per round (block medians): median {statistics.median(paired):.3f} "
        f"(IQR {lo:.3f}-{hi:.3f}) over {len(paired)} rounds"
    )
    if args["generate"]:
        paired = round_ratios(times["generate, always"], times["generate, never"], args["steps"])
        lo, hi = quartiles(paired)
        mid = statistics.median(paired)
        print(f"generate, always / never per round: median {mid:.3f} (IQR {lo:.3f}-{hi:.3f})")
    if ns.json is not None:
        out = {"args": vars(ns) | {"json": str(ns.json)}, "times": times, "collectives": res["collectives"]}
        ns.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
