"""Every mesh shape of a world, measured next to ``dtlab advise``'s prediction (``dtlab bench``'s 3-D table).

For the embedded transformer (sizes below), every ``pp x dp x tp`` shape of the world that the model
allows (tp dividing the heads, pp the layers, as ``dtlab train`` checks them) and every data-parallel
strategy: the model and optimizer strategies exactly as ``dtlab train`` builds them (``parallel.*`` and
``strategy.model`` in the config; AdamW, 1F1B with ``2 pp`` micro-batches where the batch allows),
``model.train_step`` + ``opt.step()`` on random tokens. Reported per configuration:

- step time: per step the slowest rank's, median over the measured steps (with ``--rounds R`` the
  whole sweep runs R times interleaved and each configuration reports its median round);
- bytes per rank per axis: what one rank sends on its dp, tp and pp groups per step (``backend.stats``,
  the largest over ranks), next to ``dtlab advise``'s ``axes[axis].bytes_sent``;
- memory per rank, of the rank holding the most: its state (parameters + gradients + optimizer state
  after the step, ``memory_report()``) and its activations (a pipeline's own count; without one, the
  storages autograd saves during one more step, not measured under ZeRO-3/FSDP), next to the
  prediction's ``memory`` (its ``transient`` and ``recompute`` left out: what ZeRO-3/FSDP gather and a
  checkpointed backward rebuilds for a moment is not held across a step).

``--checkpointing``: every configuration with ``strategy.activation_checkpointing=true`` (per stage
under a pipeline, per block without one), predicted as such; ``--find-unused-parameters``: with
``strategy.find_unused_parameters=true``, predicted as such.

Engines: ``inmemory`` (``--ranks`` threads of one process, default 8) and ``gloo``/``mpi`` (4
processes, every configuration in one spawned world). Run::

    python -m dtlab.benchmarks.mesh                                # in-memory, 8 ranks, all strategies
    python -m dtlab.benchmarks.mesh --engines inmemory,gloo,mpi --strategies ddp,zero2,fsdp
    dtlab bench --only mesh --out runs/bench                       # the same table, plots in bench.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dtlab.benchmarks._mesh_measure import measure, world_runs
from dtlab.benchmarks._mesh_report import constants, fit, row, spearman, table
from dtlab.config import TrainConfig, load_config
from dtlab.core import pairs

__all__ = ["main", "mesh_shapes"]

STRATEGIES = pairs.DATA_PARALLEL


def mesh_shapes(world: int, heads: int, layers: int) -> list[tuple[int, int, int]]:
    """``(pp, dp, tp)`` for every factorisation of ``world`` the model allows, pp outermost."""
    out = []
    for pp in range(1, world + 1):
        for tp in range(1, world // pp + 1):
            if world % (pp * tp) or heads % tp or 256 % tp or layers % pp:
                continue
            out.append((pp, world // (pp * tp), tp))
    return out


def _micro_batches(pp: int, dp: int, batch: int) -> int:
    local = batch // dp
    return 2 * pp if local % (2 * pp) == 0 else pp


def _config(args: argparse.Namespace, shape: tuple[int, int, int], strategy: str, world: int) -> TrainConfig:
    pp, dp, tp = shape
    sets = [
        "backend.name=inmemory",
        f"backend.world_size={world}",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}",
        f"model.seq_len={args.seq}",
        f"data.global_batch_size={args.batch}",
        f"strategy.model={strategy}",
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        "optimizer.name=adamw",
    ]
    if pp > 1:
        sets.append(f"parallel.micro_batches={_micro_batches(pp, dp, args.batch)}")
    if getattr(args, "checkpointing", False):  # per stage with a pipeline, per block without
        sets.append("strategy.activation_checkpointing=true")
    if getattr(args, "find_unused_parameters", False):
        sets.append("strategy.find_unused_parameters=true")
    return load_config(overrides=sets)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from dtlab.testing import run_world, spawn_world

    strategies = [s for s in args.strategies.split(",") if s]
    rows = []
    for engine in [e for e in args.engines.split(",") if e]:
        world = args.ranks if engine == "inmemory" else 4
        shapes = mesh_shapes(world, args.heads, args.layers)
        plans = [(shape, s) for shape in shapes for s in strategies]
        configs = [_config(args, shape, s, world) for shape, s in plans]
        print(f"[mesh] {engine}: {len(plans)} configurations on {world} ranks", file=sys.stderr, flush=True)
        results: list[list[list[dict[str, Any]]]] = [[] for _ in configs]  # config -> round -> ranks
        if engine == "inmemory":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one thread per rank, as a spawned rank has; restored after
            try:
                for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits all alike
                    for i, c in enumerate(configs):
                        results[i].append(run_world(world, measure, c, args.steps, args.warmup, timeout=600))
            finally:
                torch.set_num_threads(threads)
        else:
            per_rank = spawn_world(
                world,
                world_runs,
                configs,
                args.steps,
                args.warmup,
                args.rounds,
                backend=engine,
                timeout=3600,
                check_collectives=False,
            )
            for k in range(args.rounds):
                for i in range(len(configs)):
                    results[i].append([per_rank[r][k][i] for r in range(world)])
        for (shape, s), c, rounds in zip(plans, configs, results, strict=True):
            rows.append(row(engine, shape, s, c, rounds))
            print(f"[mesh] {rows[-1]['mesh']} {s}: {rows[-1]['step_ms']:.1f} ms", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="inmemory", help="comma-separated: inmemory, gloo, mpi")
    p.add_argument("--ranks", type=int, default=8, help="in-memory ranks (gloo/mpi: 4 processes)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="sweeps, interleaved; each configuration's median")
    p.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing (per stage, or per block)"
    )
    p.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="strategy.find_unused_parameters=true, predicted as such",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = run(args)
    notes = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        c = fit(mine)
        rho = spearman([r["step_ms"] for r in mine], [r["fitted_ms"] for r in mine])
        exact = sum(
            r["sent"] == r["predicted_sent"]
            and r["state"] == r["predicted_state"]
            and r["activations"] in (None, r["predicted_activations"])
            for r in mine
        )
        notes.append(
            f"- {engine}: advise's step-time model fitted to these {len(mine)} rows: {constants(c)}; "
            f"rank correlation with the measured step times {rho:.2f}; "
            f"bytes and memory predicted exactly in {exact} of {len(mine)} rows"
        )
    print(
        f"Embedded transformer d_model={args.d_model}, {args.layers} blocks, {args.heads} heads, "
        f"sequence {args.seq}, global batch {args.batch}, AdamW; measured / advise's prediction "
        "(= where equal); state: parameters + gradients + optimizer state of the rank holding the most"
    )
    print()
    print("\n".join(table(rows)))
    print()
    print("\n".join(notes))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
