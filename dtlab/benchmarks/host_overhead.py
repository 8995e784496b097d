"""The host (Python) time a wrapper adds to a small, fast step: two dtlab source trees against each other.

A model of many small parameters (``--blocks`` blocks of LayerNorm + Linear(64, 64), 4 parameters
each, a tiny batch) under DDP, ZeRO-2, ZeRO-3 and FSDP on 1 and 2 in-memory ranks, and a small
TransformerLM under TensorParallelModel at tp=2: the step time is almost all host overhead, so a check
that runs every forward or step shows. Each round runs one fresh process per tree (``--trees``, the
order alternating every round), which times ``--steps`` steps of every configuration after
``--warmup``; reported per configuration: each tree's median step and IQR, and the difference of the
medians in microseconds and as a ratio to the first tree. ``--clock cpu`` times each step in the
ranks' thread CPU time, summed over the ranks (the host work itself, little moved by other processes on
a shared machine; waits in collectives not counted) instead of the slowest rank's wall time.
``--draws`` runs each step's forward and backward under the Trainer's ``RankDraws`` (an in-memory
rank's own generator for its dropout; the model draws nothing, so what shows is the cost of the watch
kept on a model that draws nothing; a one-rank world runs on a rank thread, as ``run_training`` runs
it). ``--profile`` instead prints a cProfile of ``--steps`` steps of
each configuration in this tree (1 rank).

    .venv/bin/python -m dtlab.benchmarks.host_overhead --trees /path/old /path/new --rounds 6
    .venv/bin/python -m dtlab.benchmarks.host_overhead --trees /path/old /path/new --rounds 4 --clock cpu
    .venv/bin/python -m dtlab.benchmarks.host_overhead --profile

The worker uses only API present in both trees (the model strategies, ``DataParallelOptimizer``
pairs, ``run_world``), so an older checkout can run it: the tree is put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, cast

CONFIGS = [(s, r) for r in (1, 2) for s in ("ddp", "zero2", "zero3", "fsdp")] + [("tp", 2)]


def _world(backend: Any, strategy: str, args: dict[str, Any]) -> list[float]:
    """One rank: build, warm up, and time each step (the slowest rank's wall time, as in a real step;
    ``clock="cpu"``: the ranks' thread CPU time, summed)."""
    import torch
    from torch import nn

    from dtlab.backends import Mesh, ReduceOp
    from dtlab.models import (
        DDPModel,
        FSDPModel,
        ModuleClassPolicy,
        TensorParallelModel,
        ZeRO2Model,
        ZeRO3Model,
        transformer_plan,
    )
    from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer
    from dtlab.zoo import TransformerLM

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    width, batch = 64, args["batch"]
    if strategy == "tp":
        net: nn.Module = TransformerLM(width, 2, 4, 16)
        mesh = Mesh(backend, {"tp": backend.world_size})
        model: Any = TensorParallelModel(net, mesh, plan=transformer_plan())
        opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=1e-3)
        x = torch.randint(0, 256, (batch, 16), generator=gen)
        y = torch.randint(0, 256, (batch, 16), generator=gen)

        def loss_of() -> torch.Tensor:
            return cast(torch.Tensor, model.cross_entropy(model(x), y))
    else:
        blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(args["blocks"])]
        net = nn.Sequential(*blocks)
        opt_cls: Any
        if strategy == "ddp":
            model, opt_cls = DDPModel(net, backend), DDPOptimizer
        elif strategy == "zero2":
            model, opt_cls = ZeRO2Model(net, backend), ZeRO2Optimizer
        elif strategy == "zero3":
            model, opt_cls = ZeRO3Model(net, backend), ZeRO3Optimizer
        else:
            model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((nn.Sequential,)))
            opt_cls = ZeRO3Optimizer
        opt = opt_cls(model, torch.optim.SGD, lr=1e-3)
        x = torch.randn(batch, width, generator=gen)

        def loss_of() -> torch.Tensor:
            return cast(torch.Tensor, model(x).square().mean())

    draws: Any = contextlib.nullcontext
    if args["draws"]:  # as the Trainer runs a micro-batch on in-memory ranks (an older tree: no model)
        from dtlab.trainers.rank_draws import RankDraws

        params = inspect.signature(RankDraws).parameters
        sized = [backend.world_size] if "world_size" in params else []  # an older tree's argument
        draws = RankDraws(0, backend.rank, 1, *sized, *([model] if "model" in params else []))

    def step() -> None:
        with draws():
            loss_of().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args["warmup"]):
        step()
    cpu = args["clock"] == "cpu"
    clock, op = (time.thread_time, ReduceOp.SUM) if cpu else (time.perf_counter, ReduceOp.MAX)
    times = []
    for _ in range(args["steps"]):
        backend.barrier()
        t0 = clock()
        step()
        dt = torch.tensor([clock() - t0], dtype=torch.float64)
        backend.all_reduce(dt, op)
        times.append(float(dt.item()))
    return times


def worker(args: dict[str, Any]) -> dict[str, list[float]]:
    """Every configuration in turn, in this process; their step times."""
    from dtlab.testing import run_world

    run: Any = _call
    if args["draws"]:  # one rank as run_training runs it (a tree without one_rank: the caller's thread)
        with contextlib.suppress(ImportError):
            from dtlab.trainers.one_rank import on_a_rank_thread as run
    return {f"{s}/{r}": run(run_world, r, _world, s, args, timeout=600)[0] for s, r in CONFIGS}


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def profile(args: dict[str, Any]) -> None:
    """cProfile of ``steps`` steps of each data-parallel configuration on 1 rank, top by own time."""
    import cProfile
    import pstats

    from dtlab.testing import run_world

    for s, r in [(s, r) for s, r in CONFIGS if r == 1]:  # on 2 ranks the threads escape cProfile
        prof = cProfile.Profile()
        prof.enable()
        run_world(r, _world, s, args, timeout=600)
        prof.disable()
        print(f"\n===== {s} on {r} rank(s): {args['steps']} steps (+ build and {args['warmup']} warmup)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args["top"])


def main(argv: list[str] | None = None) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--trees", nargs="*", default=[], help="dtlab source trees to compare (2 or more)")
    parser.add_argument("--rounds", type=int, default=6, help="processes per tree, alternating")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per configuration and process")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=32, help="LayerNorm + Linear blocks (4 params each)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="step time measured")
    parser.add_argument("--draws", action="store_true", help="each step under the Trainer's RankDraws")
    parser.add_argument("--profile", action="store_true", help="profile this tree instead")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    args = {k: getattr(ns, k) for k in ("steps", "warmup", "blocks", "batch", "top", "clock", "draws")}
    if ns.worker:
        print(json.dumps(worker(args)))
        return
    if ns.profile:
        profile(args)
        return
    if len(ns.trees) < 2:
        parser.error("--trees needs two dtlab source trees (or use --profile)")
    times: dict[str, dict[str, list[float]]] = {t: {} for t in ns.trees}
    code = f"import sys; sys.argv = ['w'] + sys.argv[1:]; import runpy; runpy.run_path({__file__!r})"
    for r in range(ns.rounds):
        for tree in ns.trees if r % 2 == 0 else list(reversed(ns.trees)):
            env = dict(os.environ, PYTHONPATH=tree)
            flags = [f"--{k}" if v is True else f"--{k}={v}" for k, v in args.items() if v is not False]
            cmd = [sys.executable, "-c", code, "--worker", *flags]
            run = subprocess.run  # cwd "/": "-c" puts the working directory first on sys.path
            out = run(cmd, env=env, cwd="/", check=True, capture_output=True, text=True, timeout=1800)
            for cfg, ts in json.loads(out.stdout.strip().splitlines()[-1]).items():
                times[tree].setdefault(cfg, []).extend(ts)
            print(f"round {r + 1}/{ns.rounds}: {tree} done", file=sys.stderr, flush=True)
    report(ns.trees, times, args)


def report(trees: list[str], times: dict[str, dict[str, list[float]]], args: dict[str, Any]) -> None:
    """Per configuration: each tree's median step (IQR), then each later tree against the first."""
    base, later = trees[0], trees[1:]
    what = (
        "thread CPU time summed over the ranks" if args["clock"] == "cpu" else "the slowest rank's wall time"
    )
    model = f"{args['blocks']} blocks of LayerNorm + Linear(64, 64), batch {args['batch']}"
    print(f"\n{model}; {what}; medians (IQR)")
    heads = [f"{t} (ms)" for t in trees] + [f"{t} - {base} (us/step, ratio)" for t in later]
    print("| configuration | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for cfg in times[base]:
        med = {t: statistics.median(times[t][cfg]) for t in trees}
        cells = []
        for t in trees:
            q = statistics.quantiles(times[t][cfg], n=4)
            cells.append(f"{1e3 * med[t]:.2f} ({1e3 * q[0]:.2f}-{1e3 * q[2]:.2f})")
        for t in later:
            cells.append(f"{1e6 * (med[t] - med[base]):+.0f} ({med[t] / med[base]:.3f})")
        print(f"| {cfg} | " + " | ".join(cells) + " |")


if __name__ in ("__main__", "<run_path>"):
    main()
