"""``dtlab advise``: its flags and what it prints (the ``cli`` module only dispatches here)."""

from __future__ import annotations

import argparse
import sys

from dtlab.advise.render import advice_json, advice_table, print_table
from dtlab.advise.search import advise
from dtlab.advise.spec import DP_STRATEGIES, ClusterSpec, ModelSpec, OptimizerSpec
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
    m.add_argument("--dtype-bytes", type=int, default=4, help="bytes per value (default 4: fp32)")
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
    t = a.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=32, help="sequences per step (default %(default)s)")
    t.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    t.add_argument(
        "--strategies",
        default=",".join(DP_STRATEGIES),
        help="data-parallel strategies to consider, comma-separated (default: all)",
    )
    t.add_argument("--no-checkpointing", action="store_true", help="leave out activation checkpointing")
    t.add_argument("--runnable-only", action="store_true", help="only plans dtlab's strategies run today")
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
            dtype_bytes=args.dtype_bytes,
        )
    hidden = args.hidden or base.hidden
    return ModelSpec(layers, hidden, heads, vocab, seq, args.dtype_bytes, base.name)


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
    )
    if args.top < 0:
        raise ArgumentError(f"--top must be >= 0 (0: all), got {args.top}")
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    result = advise(
        spec,
        cluster,
        args.global_batch,
        optimizer=OptimizerSpec(args.optimizer),
        strategies=strategies,
        checkpointing=(False,) if args.no_checkpointing else (False, True),
        runnable_only=args.runnable_only,
    )
    shown = result.plans[: args.top] if args.top else result.plans
    if args.json:
        print(advice_json(shown, spec, cluster, args.global_batch, result.considered, len(result.plans)))
        return 0
    if not result.plans:
        print(
            f"dtlab advise: none of the {result.considered} plans fits in {cluster.memory_gib:g} GiB per "
            "device; add ranks or memory, or shrink the model or the global batch",
            file=sys.stderr,
        )
        return 1
    print_table(advice_table(shown, spec, cluster, args.global_batch, result.considered, len(result.plans)))
    return 0
