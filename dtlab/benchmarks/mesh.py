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
  storages autograd saves during one more step, not measurable under ZeRO-3/FSDP whose hooks replace
  them), next to the prediction's ``memory`` (its ``transient`` and ``recompute`` left out: what
  ZeRO-3/FSDP gather and a checkpointed backward rebuilds for a moment is not held across a step).

``--checkpointing``: every configuration with ``strategy.activation_checkpointing=true`` (per stage
under a pipeline, per block without one), predicted as such.

Engines: ``inmemory`` (``--ranks`` threads of one process, default 8) and ``gloo``/``mpi`` (4
processes, every configuration in one spawned world). Run::

    python -m dtlab.benchmarks.mesh                                # in-memory, 8 ranks, all strategies
    python -m dtlab.benchmarks.mesh --engines inmemory,gloo,mpi --strategies ddp,zero2,fsdp
    dtlab bench --only mesh --out runs/bench                       # the same table, plots in bench.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, OptimizerSpec, predict
from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.core import pairs
from dtlab.data import TensorDataset
from dtlab.parallel_config import run_plan
from dtlab.trainers.build import build_model_strategy, build_optimizer_strategy
from dtlab.trainers.parallel import parallel_loss
from dtlab.trainers.tasks import Task, cross_entropy_loss
from dtlab.zoo import Block, TransformerLM

__all__ = ["main", "mesh_shapes"]

STRATEGIES = pairs.DATA_PARALLEL
AXES = ("dp", "tp", "pp")


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
    return load_config(overrides=sets)


def _task(config: TrainConfig) -> Task:
    m = config.model
    tokens = torch.zeros(4, m.seq_len, dtype=torch.long)
    data = TensorDataset(tokens, tokens)
    return Task(
        build_model=lambda: TransformerLM(m.d_model, m.n_layers, m.n_heads, m.seq_len),
        train_data=data,
        eval_data=data,
        fsdp_unit_classes=(Block,),
    )


def _groups(model: Any) -> dict[str, CommunicationBackend]:
    mesh = getattr(model, "mesh", None)
    if mesh is None:
        return {"dp": model.dp_backend}
    return {a: mesh[a] for a in AXES}


def _measure(backend: CommunicationBackend, config: TrainConfig, steps: int, warmup: int) -> dict[str, Any]:
    """One configuration on this rank: step times, bytes per axis per step, the memory report."""
    model, _ = build_model_strategy(config, backend, _task(config))
    opt = build_optimizer_strategy(config, model)
    loss_fn = parallel_loss(model, cross_entropy_loss, cross_entropy_loss, config.parallel.tp)
    groups = _groups(model)
    dp = model.dp_backend
    g = torch.Generator().manual_seed(1 + dp.rank)
    local = config.data.global_batch_size // dp.world_size
    seq = config.model.seq_len
    times = []
    acts: int | None = None
    for i in range(warmup + steps):
        x = torch.randint(0, 256, (local, seq), generator=g)
        y = torch.randint(0, 256, (local, seq), generator=g)
        if i == warmup:
            for group in groups.values():
                group.stats.reset()
        backend.barrier()
        t0 = time.perf_counter()
        model.train_step((x, y), loss_fn)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    memory = opt.memory_report()
    sent = {a: g.stats.bytes_sent // steps for a, g in groups.items()}
    if "activations" in memory:  # a pipeline counts them itself
        acts = memory["activations"]
    elif config.strategy.model not in ("zero3", "fsdp"):  # their own saved-tensor hooks hide them
        saved = _SavedBytes([*model.parameters(), x, y])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            model.train_step((x, y), loss_fn)
        opt.zero_grad()
        acts = saved.total
    return {"times": times[warmup:], "sent": sent, "memory": memory, "activations": acts}


class _SavedBytes:
    """Bytes autograd keeps for the backward: distinct storages, parameters and the batch left out
    (as the pipeline's meter counts them)."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in excluded if t.numel()}
        self._seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.numel() and st.data_ptr() not in self._excluded:
            self._seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def _world_runs(
    backend: CommunicationBackend, configs: list[TrainConfig], steps: int, warmup: int, rounds: int
) -> list[list[Any]]:
    """Every configuration in one world (spawned engines), ``rounds`` times interleaved: per round, one
    result per configuration."""
    return [[_measure(backend, c, steps, warmup) for c in configs] for _ in range(rounds)]


def _step_seconds(ranks: list[dict[str, Any]]) -> float:
    """Per step the slowest rank's time; the median over the steps."""
    return float(statistics.median(max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))))


def _row(
    engine: str,
    shape: tuple[int, int, int],
    strategy: str,
    config: TrainConfig,
    rounds: list[list[dict[str, Any]]],
) -> dict[str, Any]:
    pp, dp, tp = shape
    m = config.model
    ranks = rounds[0]
    step_s = statistics.median(_step_seconds(r) for r in rounds)  # the median round

    def state(mem: dict[str, int]) -> int:
        return mem["parameters"] + mem["gradients"] + mem["optimizer_state"]

    worst = max(ranks, key=lambda r: state(r["memory"]) + (r["activations"] or 0))
    spec = ModelSpec.builtin(d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, seq_len=m.seq_len)
    plan = Candidate.from_plan(run_plan(config, pp * dp * tp))  # the run plan the Trainer builds
    world, batch = dp * tp * pp, config.data.global_batch_size
    p = predict(spec, ClusterSpec(ranks=world), plan, batch, optimizer=OptimizerSpec())
    # the predicted rank holding the most, by the measure the measured one is chosen by
    pm = max(p.stage_memory, key=lambda m: m.parameters + m.gradients + m.optimizer_state + m.activations)
    # the step time's terms: seconds per 1/(TFLOP/s), per microsecond of latency, per 1/(Gbit/s)
    lat = predict(spec, ClusterSpec(ranks=world, latency_us=1.0, bandwidth_gbps=1e15), plan, batch)
    bw = predict(spec, ClusterSpec(ranks=world, latency_us=0.0, bandwidth_gbps=1.0), plan, batch)
    terms = [
        p.compute_seconds * ClusterSpec(ranks=world).tflops / (1.0 - p.bubble),
        sum(a.seconds for a in lat.axes.values()),
        sum(a.seconds for a in bw.axes.values()),
    ]
    return {
        "engine": engine,
        "mesh": f"pp{pp} dp{dp} tp{tp}",
        "pp": pp,
        "dp": dp,
        "tp": tp,
        "strategy": strategy,
        "micro_batches": plan.micro_batches,
        "step_ms": step_s * 1e3,
        "sent": {a: max(r["sent"].get(a, 0) for r in ranks) for a in AXES},
        "predicted_sent": {a: p.axes[a].bytes_sent if a in p.axes else 0 for a in AXES},
        "state": state(worst["memory"]),
        "activations": worst["activations"],
        "memory_parts": worst["memory"],
        "predicted_state": pm.parameters + pm.gradients + pm.optimizer_state,
        "predicted_activations": pm.activations,
        "predicted_step_ms": p.step_seconds * 1e3,
        "terms": terms,
    }


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _pair(got: int, want: int) -> str:
    if got == want:
        return f"{_mb(got)} = "
    return f"{_mb(got)} / {_mb(want)}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per configuration, measured / predicted (``=`` where equal)."""
    head = [
        "engine",
        "mesh",
        "strategy",
        "step ms",
        "advise ms (fitted)",
        "dp MiB/step",
        "tp MiB/step",
        "pp MiB/step",
        "state MiB/rank",
        "activations MiB/rank",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["engine"],
            r["mesh"] + (f" m{r['micro_batches']}" if r["pp"] > 1 else ""),
            r["strategy"],
            f"{r['step_ms']:.1f}",
            f"{r.get('fitted_ms', float('nan')):.1f}",
            *(_pair(r["sent"][a], r["predicted_sent"][a]) for a in AXES),
            _pair(r["state"], r["predicted_state"]),
            "- / " + _mb(r["predicted_activations"])
            if r["activations"] is None
            else _pair(r["activations"], r["predicted_activations"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two lists (ties broken by position)."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    d = sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True))
    return 1.0 - 6.0 * d / (n * (n * n - 1))


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """This machine's constants for advise's step-time model, by least squares over ``rows`` (one
    engine): step = compute / TFLOP/s / (1 - bubble) + calls x latency + bytes / bandwidth. Fills
    ``fitted_ms`` in each row; returns the constants (in-sample: how much the model's shape explains)."""
    a = torch.tensor([r["terms"] for r in rows], dtype=torch.float64)
    b = torch.tensor([r["step_ms"] / 1e3 for r in rows], dtype=torch.float64)
    x = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).clamp(min=1e-18)
    for r, pred in zip(rows, (a @ x).tolist(), strict=True):
        r["fitted_ms"] = pred * 1e3
    return {"tflops": 1.0 / float(x[0]), "latency_us": float(x[1]), "bandwidth_gbps": 1.0 / float(x[2])}


def _constants(c: dict[str, float]) -> str:
    bw = "bytes at no measurable cost" if c["bandwidth_gbps"] > 1e12 else f"{c['bandwidth_gbps']:.3g} Gbit/s"
    return f"{c['tflops'] * 1e3:.3g} GFLOP/s per rank, {c['latency_us']:.0f} us per message step, {bw}"


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
            torch.set_num_threads(1)
            for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits all alike
                for i, c in enumerate(configs):
                    results[i].append(run_world(world, _measure, c, args.steps, args.warmup, timeout=600))
        else:
            per_rank = spawn_world(
                world,
                _world_runs,
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
            rows.append(_row(engine, shape, s, c, rounds))
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
            f"- {engine}: advise's step-time model fitted to these {len(mine)} rows: {_constants(c)}; "
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
