"""The mesh benchmark's rows (``dtlab.benchmarks.mesh``): each configuration measured next to
``dtlab advise``'s prediction, the markdown table, and advise's step-time model fitted to the measured
step times (its constants and rank correlation)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, OptimizerSpec, StrategyOptions, predict
from dtlab.benchmarks._mesh_measure import AXES
from dtlab.config import TrainConfig
from dtlab.parallel_config import run_plan

__all__ = ["constants", "fit", "row", "spearman", "table"]


def _step_seconds(ranks: list[dict[str, Any]]) -> float:
    """Per step the slowest rank's time; the median over the steps."""
    return float(statistics.median(max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))))


def row(
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
    opts = StrategyOptions(find_unused_parameters=config.strategy.find_unused_parameters)
    p = predict(spec, ClusterSpec(ranks=world), plan, batch, optimizer=OptimizerSpec(), options=opts)
    # the predicted rank holding the most, by the measure the measured one is chosen by
    pm = max(p.stage_memory, key=lambda m: m.parameters + m.gradients + m.optimizer_state + m.activations)
    # the step time's terms: seconds per 1/(TFLOP/s), per microsecond of latency, per 1/(Gbit/s)
    lat = predict(
        spec, ClusterSpec(ranks=world, latency_us=1.0, bandwidth_gbps=1e15), plan, batch, options=opts
    )
    bw = predict(
        spec, ClusterSpec(ranks=world, latency_us=0.0, bandwidth_gbps=1.0), plan, batch, options=opts
    )
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


def constants(c: dict[str, float]) -> str:
    bw = "bytes at no measurable cost" if c["bandwidth_gbps"] > 1e12 else f"{c['bandwidth_gbps']:.3g} Gbit/s"
    return f"{c['tflops'] * 1e3:.3g} GFLOP/s per rank, {c['latency_us']:.0f} us per message step, {bw}"
