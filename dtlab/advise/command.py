"""``dtlab advise``: its flags and what it prints (the ``cli`` module only dispatches here)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from dtlab.advise.plan import parse_plan, place
from dtlab.advise.precision import PRECISIONS, Precision
from dtlab.advise.predict import Prediction, predict
from dtlab.advise.render import advice_json, advice_table, print_table
from dtlab.advise.search import Limits, advise, runnable
from dtlab.advise.spec import (
    BYTE_VOCAB,
    CHECKPOINTING,
    DP_STRATEGIES,
    SCHEDULES,
    ClusterSpec,
    ModelSpec,
    OptimizerSpec,
    StrategyOptions,
)
from dtlab.advise.to_train import train_settings
from dtlab.core.plan import TP_BATCH_CHECKS
from dtlab.errors import ArgumentError

__all__ = ["add_advise_parser", "run_advise"]

_DEFAULT = ModelSpec.builtin()
_CLUSTER = ClusterSpec(ranks=8)


def add_advise_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    a = sub.add_parser(
        "advise",
        help="rank every plan (strategy, dp, tp, pp, schedule, micro-batches, ...) by predicted step time",
        description=(
            "Predict memory per rank, bytes per rank per mesh axis and step time of every plan for a "
            "transformer on a cluster, and list those that fit, fastest first (formulas: "
            "docs/strategies.md, 'Choosing a mesh: the cost model')."
        ),
    )
    m = a.add_argument_group("model (default: dtlab's embedded transformer with dtlab train's sizes)")
    m.add_argument("--model", default="transformer", help="the built-in model: 'transformer'")
    m.add_argument("--layers", type=int, help=f"transformer blocks (default {_DEFAULT.layers})")
    m.add_argument("--hidden", type=int, help=f"model width d_model (default {_DEFAULT.hidden})")
    m.add_argument("--heads", type=int, help=f"attention heads (default {_DEFAULT.heads})")
    m.add_argument("--vocab", type=int, help=f"vocabulary size (default {_DEFAULT.vocab}: bytes)")
    m.add_argument("--seq", type=int, help=f"sequence length (default {_DEFAULT.seq_len})")
    m.add_argument("--params", type=float, help="parameter count (e.g. 1.3e9): picks --hidden to match it")
    m.add_argument(
        "--tied-embeddings", action="store_true", help="the head is the token embedding (one weight)"
    )
    m.add_argument(
        "--attention",
        choices=["fused", "materialized"],
        default="fused",
        help="fused (dtlab's, FlashAttention: no s x s matrix kept) or materialized (the softmax of "
        "every head kept for the backward) (default %(default)s)",
    )
    m.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32, or bf16-mixed/fp16-mixed as dtlab train runs them (fp32 parameters, gradients "
        "and Adam states; 2-byte compute copies and activations) (default %(default)s)",
    )
    c = a.add_argument_group("cluster")
    c.add_argument("--ranks", type=int, default=_CLUSTER.ranks, help="devices (default %(default)s)")
    c.add_argument(
        "--ranks-per-node", type=int, default=_CLUSTER.ranks_per_node, help="(default %(default)s)"
    )
    c.add_argument(
        "--memory-gb", type=float, default=_CLUSTER.memory_gib, help="GiB per device (%(default)s)"
    )
    c.add_argument(
        "--tflops", type=float, default=_CLUSTER.tflops, help="TFLOP/s reached per device (%(default)s)"
    )
    c.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=_CLUSTER.bandwidth_gbps,
        help="Gbit/s inside a node (%(default)s)",
    )
    c.add_argument(
        "--latency-us", type=float, default=_CLUSTER.latency_us, help="us inside a node (%(default)s)"
    )
    c.add_argument(
        "--inter-node-bandwidth-gbps",
        type=float,
        default=_CLUSTER.inter_node_bandwidth_gbps,
        help="Gbit/s between nodes (%(default)s)",
    )
    c.add_argument(
        "--inter-node-latency-us",
        type=float,
        default=_CLUSTER.inter_node_latency_us,
        help="us between nodes (%(default)s)",
    )
    c.add_argument(
        "--gemm-knee",
        type=float,
        default=_CLUSTER.gemm_knee,
        help="matrix dimension at which a product runs at half --tflops (%(default)s)",
    )
    t = a.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=32, help="sequences per step (default %(default)s)")
    t.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    t.add_argument(
        "--strategies",
        default=",".join(DP_STRATEGIES),
        help="data-parallel strategies to consider, comma-separated (default: all)",
    )
    t.add_argument(
        "--checkpointing",
        default=",".join(CHECKPOINTING),
        help="activation checkpointing modes to consider: none, block, stage (default: all)",
    )
    t.add_argument("--no-checkpointing", action="store_true", help="only plans without checkpointing")
    t.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="pipeline schedules to consider (default: all)"
    )
    t.add_argument("--max-tp", type=int, help="largest tensor-parallel size (default: --ranks-per-node)")
    t.add_argument(
        "--micro-batch",
        help="sequences per micro-batch to consider, comma-separated (default: every size dividing "
        "the batch per dp rank; the rest of it is accumulated or pipelined)",
    )
    t.add_argument(
        "--tp-batch-check",
        choices=TP_BATCH_CHECKS,
        default="always",
        help="how often the models compare the tp ranks' batches (dtlab train's parallel.tp_batch_check): "
        "always counts the check's all-reduce in every step; first and never count none, the steady "
        "step of a model built with them (default %(default)s)",
    )
    t.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="count what dtlab train's strategy.find_unused_parameters=true sends: one all-reduce per step "
        "of which parameters each rank used; under a pipeline, in place of its check of unused parameters "
        "over dp, one all-reduce of one value",
    )
    t.add_argument("--runnable-only", action="store_true", help="only plans dtlab's strategies run today")
    t.add_argument(
        "--plan",
        help='evaluate one plan and place it among all, e.g. "dp=8,tp=4,pp=12,strategy=zero1,'
        'schedule=1f1b,micro_batch=2,checkpointing=full" (keys: docs/strategies.md)',
    )
    o = a.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="plans to show (default %(default)s; 0: all)")
    o.add_argument("--json", action="store_true", help="JSON instead of a table")


def _model(args: argparse.Namespace) -> ModelSpec:
    base = ModelSpec.builtin(args.model)
    layers = args.layers or base.layers
    heads = args.heads or base.heads
    vocab = args.vocab or base.vocab
    seq = args.seq or base.seq_len
    for flag, v in [("--layers", args.layers), ("--hidden", args.hidden), ("--heads", args.heads),
                    ("--vocab", args.vocab), ("--seq", args.seq)]:  # fmt: skip
        if v is not None and v < 1:
            raise ArgumentError(f"{flag} must be >= 1, got {v}")
    if args.params is not None:
        if args.hidden is not None:
            raise ArgumentError("give --params or --hidden, not both (--params picks the hidden size)")
        if not args.params >= 1:
            raise ArgumentError(f"--params must be >= 1, got {args.params}")
        return ModelSpec.from_parameters(
            int(args.params),
            layers=layers,
            heads=heads,
            vocab=vocab,
            seq_len=seq,
            tied_embeddings=args.tied_embeddings,
            fused_attention=args.attention == "fused",
        )
    hidden = args.hidden or base.hidden
    return ModelSpec(
        layers, hidden, heads, vocab, seq, base.name, args.tied_embeddings, args.attention == "fused"
    )


def _names(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ArgumentError(f"{flag}: {', '.join(bad) or 'nothing'}; choose from {', '.join(allowed)}")
    return names


def _limits(args: argparse.Namespace) -> Limits:
    sizes = None
    if args.micro_batch:
        try:
            sizes = tuple(int(x) for x in args.micro_batch.split(",") if x.strip())
        except ValueError:
            raise ArgumentError(f"--micro-batch: {args.micro_batch!r} is not a list of integers") from None
        if not sizes or min(sizes) < 1:
            raise ArgumentError(f"--micro-batch: sizes must be integers >= 1, got {args.micro_batch!r}")
    if args.max_tp is not None and args.max_tp < 1:
        raise ArgumentError(f"--max-tp must be >= 1, got {args.max_tp}")
    modes: tuple[str, ...] = ("none",)
    if not args.no_checkpointing:
        modes = _names("--checkpointing", args.checkpointing, CHECKPOINTING)
    return Limits(
        strategies=_names("--strategies", args.strategies, DP_STRATEGIES),
        schedules=_names("--schedules", args.schedules, SCHEDULES),
        checkpointing=modes,
        max_tp=args.max_tp,
        micro_batch=sizes,
    )


def _emit(write: Callable[[], None]) -> int:
    """Write to stdout; a reader that stops early (``| head``) ends the output quietly."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
    return 0


def run_advise(args: argparse.Namespace) -> int:
    spec = _model(args)
    cluster = ClusterSpec(
        ranks=args.ranks,
        memory_gib=args.memory_gb,
        tflops=args.tflops,
        bandwidth_gbps=args.bandwidth_gbps,
        latency_us=args.latency_us,
        inter_node_bandwidth_gbps=args.inter_node_bandwidth_gbps,
        inter_node_latency_us=args.inter_node_latency_us,
        ranks_per_node=args.ranks_per_node,
        gemm_knee=args.gemm_knee,
    )
    if args.top < 0:
        raise ArgumentError(f"--top must be >= 0 (0: all), got {args.top}")
    precision = Precision.named(args.precision)
    optimizer = OptimizerSpec(args.optimizer)
    options = StrategyOptions(
        tp_batch_check=args.tp_batch_check, find_unused_parameters=args.find_unused_parameters
    )
    plan = parse_plan(args.plan, cluster.ranks, args.global_batch) if args.plan else None
    result = advise(
        spec,
        cluster,
        args.global_batch,
        optimizer=optimizer,
        options=options,
        precision=precision,
        runnable_only=args.runnable_only,
        limits=_limits(args),
    )
    header = (spec, cluster, args.global_batch, result.considered, len(result.plans), precision)
    if plan is not None:
        given = predict(
            spec,
            cluster,
            plan,
            args.global_batch,
            optimizer=optimizer,
            options=options,
            precision=precision,
            runnable=runnable(plan, spec, precision),
        )
        if given.problems and not given.fits:
            print(f"dtlab advise: the plan {plan.label} cannot run: {'; '.join(given.problems)}",
                  file=sys.stderr)  # fmt: skip
            if args.json:
                _emit(lambda: print(advice_json([given], *header, given=(given, 0))))
            return 1
        rank = place(given, result.plans)
        best = result.plans[: max(args.top, 1)] if args.top else result.plans
        if args.json:
            return _emit(lambda: print(advice_json(best, *header, given=(given, rank))))
        table = advice_table([given, *best], *header, given_rank=rank)
        return _emit(lambda: _table_and_command([given], header, args, table, "the given plan"))
    shown = result.plans[: args.top] if args.top else result.plans
    if args.json:
        return _emit(lambda: print(advice_json(shown, *header)))
    if not result.plans:
        top = sorted(result.reasons.items(), key=lambda kv: -kv[1])[:3]
        why = "; ".join(f"{reason} ({n} of them)" for reason, n in top)
        print(
            f"dtlab advise: none of the {result.considered} plans fits{': ' + why if why else ''} (a "
            f"data-parallel size that does not divide --global-batch {args.global_batch} is not "
            "considered); change --ranks or --global-batch, add memory, or shrink the model",
            file=sys.stderr,
        )
        return 1
    return _emit(lambda: _table_and_command(shown, header, args))


def _table_and_command(
    shown: list[Prediction],
    header: tuple[Any, ...],
    args: argparse.Namespace,
    table: Any = None,
    which: str = "",
) -> None:
    """The table, then the fastest plan of ``shown`` dtlab runs today (``which`` names it, by default
    its place) as a ``dtlab train`` command line."""
    spec = header[0]
    print_table(advice_table(shown, *header) if table is None else table)
    best = next((p for p in shown if p.runnable), None)
    sets = [] if best is None else train_settings(best, spec, args.global_batch, args.precision)
    if best is None or not sets:
        return
    sets += ["strategy.find_unused_parameters=true"] if args.find_unused_parameters else []
    yours = spec.vocab != BYTE_VOCAB or spec.tied_embeddings
    print(
        f"{which or f'plan {shown.index(best) + 1}'} ({best.candidate.label}) with dtlab train"
        + (" (your model through model.factory)" if yours else "")
        + ":\n  dtlab train "
        + " ".join(f"--set {s}" for s in sets)
    )
