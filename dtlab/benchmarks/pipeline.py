"""Pipeline parallelism: measured bubbles against the formulas; dtlab against torch.distributed.pipelining.

    .venv/bin/python -m dtlab.benchmarks.pipeline bubble                 # 4 gloo ranks, stages that sleep
    .venv/bin/python -m dtlab.benchmarks.pipeline torch                  # 2 gloo ranks, dtlab vs torch
    .venv/bin/python -m dtlab.benchmarks.pipeline bubble --m 4,8 --block-ms 10 --steps 3 --plots docs/img

``bubble``: a model of 8 blocks whose forward, input-gradient and weight-gradient each sleep
``--block-ms`` (the weight-gradient through ``defer_weight_gradient``, so zero-bubble can move it), on
``--pp`` gloo processes (sleeping stages, so two cores run four ranks). For each schedule and ``m``,
every rank records its compute intervals (``model.last_timeline()``) and the idle fraction of the step
is ``1 - busy / (ranks x makespan)``, makespan from the first compute to the last; the best of
``--steps`` steps after one warm-up is reported against (p-1)/(m+p-1) (GPipe, 1F1B),
(p-1)/(v m+p-1) (interleaved) and the planned timeline's (zero-bubble). *replayed* is the idle fraction
of the same schedule simulated with every action's measured duration and instant messages: the part of
the measured idle time that the actions' own lengths (sleeps overshooting on a loaded machine)
explain; the difference to *measured* is communication latency. ``--plots`` writes each schedule's
planned and measured timeline.

``torch``: the same MLP (``--layers`` x Linear(d, d) + GELU), the same stages and micro-batches, trained
by dtlab's PipelineParallelModel (DDPOptimizer, SGD) and by torch's ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B (PipelineStage given the input shape, SGD) in the same gloo
processes, alternating in blocks of ``--steps`` steps for ``--rounds`` rounds; each step timed as the
slowest rank's; per variant the median step with its quartiles (and the best) is reported, the ratio
of the medians, and the ratio within each round (the two blocks back to back) with its median,
quartiles and range; both first-step losses as a check, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._paired import measure, round_ratios

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from dtlab.backends.base import CommunicationBackend
    from dtlab.models import PipelineParallelModel
    from dtlab.optimizers import DDPOptimizer

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))


# ---------------------------------------------------------------------------------------------- bubble
def _sleep_model(blocks: int, seconds: float) -> torch.nn.Sequential:
    import torch
    from torch import nn

    from dtlab.models.pipeline import defer_weight_gradient, weight_gradient_queue

    class SleepFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, queue: Any) -> Any:
            time.sleep(seconds)
            ctx.save_for_backward(x)
            ctx.w, ctx.queue = w, queue
            return x * w

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            w = ctx.w

            def weight_gradient() -> None:
                time.sleep(seconds)
                w.grad.add_((g * x).sum(0))

            time.sleep(seconds)  # the input-gradient
            defer_weight_gradient(weight_gradient, ctx.queue)
            return g * w, None, None

    class SleepBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: Any) -> Any:
            return SleepFn.apply(x, self.w, weight_gradient_queue(x))  # type: ignore[no-untyped-call]

    return nn.Sequential(*[SleepBlock() for _ in range(blocks)])


def bubble_world(backend: CommunicationBackend, args: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from dtlab.models import PipelineParallelModel

    p, out = backend.world_size, []
    for schedule, v in SCHEDULES:
        for m in args["m"]:
            if v > 1 and m % p:
                continue
            model = PipelineParallelModel(
                _sleep_model(args["blocks"], args["block_ms"] / 1e3),
                backend,
                schedule,
                micro_batches=m,
                stages_per_rank=v,
            )
            gen = torch.Generator().manual_seed(m)  # the same batch on every pipeline rank (checked)
            x, y = torch.randn(2 * m, 4, generator=gen), torch.randn(2 * m, 4, generator=gen)
            steps = []
            for _ in range(args["steps"] + 1):
                backend.barrier()
                t0 = time.perf_counter()
                model.train_step((x, y), lambda a, b: ((a - b) ** 2).mean())
                wall = time.perf_counter() - t0
                for q in model.module.parameters():
                    if q.grad is not None:
                        q.grad.zero_()
                timelines = backend.all_gather_object(model.last_timeline())
                steps.append({"wall": wall, "timelines": timelines})
            out.append({"schedule": schedule, "v": v, "m": m, "steps": steps[1:]})
    return out


def _idle(timelines: list[list[tuple[Any, float, float]]]) -> tuple[float, float]:
    start = min(iv[0][1] for iv in timelines if iv)
    end = max(iv[-1][2] for iv in timelines if iv)
    busy = sum(e - s for iv in timelines for _, s, e in iv)
    return 1.0 - busy / (len(timelines) * (end - start)), end - start


def run_bubble(ns: argparse.Namespace) -> list[dict[str, Any]]:
    from dtlab.models.pipeline import Kind, Timeline, build_schedule, plot_schedule, simulate
    from dtlab.testing import spawn_world

    args = {"m": ns.m, "blocks": ns.blocks, "block_ms": ns.block_ms, "steps": ns.steps}
    res = spawn_world(ns.pp, bubble_world, args, backend=ns.engine, timeout=1800)[0]
    p, rows = ns.pp, []
    for r in res:
        v, m = r["v"], r["m"]
        per_stage = ns.blocks / (p * v) * ns.block_ms / 1e3  # seconds of F (= I = W) of one stage
        costs = {Kind.F: per_stage, Kind.B: 2 * per_stage, Kind.I: per_stage, Kind.W: per_stage}
        planned = simulate(build_schedule(r["schedule"], p, m, v), costs)
        measured = [_idle(s["timelines"]) for s in r["steps"]]
        best = min(range(len(measured)), key=lambda i: measured[i][0])
        idle, span = measured[best]
        # the same schedule replayed with each action's measured duration and messages taking no time:
        # what the actions' own lengths explain; the rest of the measured idle time is communication
        took = {(rank, a): e - b for rank, iv in enumerate(r["steps"][best]["timelines"]) for a, b, e in iv}

        def measured_duration(rank: int, a: Any, took: dict[Any, float] = took) -> float:
            return took[(rank, a)]

        replay = simulate(build_schedule(r["schedule"], p, m, v), duration=measured_duration)
        formula = (p - 1) / (v * m + p - 1)
        want = formula if r["schedule"] != "zero_bubble" else planned.bubble()
        rows.append(
            {
                "schedule": r["schedule"],
                "p": p,
                "m": m,
                "v": v,
                "formula": formula,
                "planned": planned.bubble(),
                "measured": idle,
                "measured_over_expected": idle / want,
                "replayed": replay.bubble(),
                "makespan_s": span,
                "planned_makespan_s": planned.makespan,
                "step_s": r["steps"][best]["wall"],
            }
        )
        if ns.plots and m == max(ns.m):
            path = Path(ns.plots) / f"pipeline_bubble_{r['schedule']}.png"
            timeline = Timeline([list(iv) for iv in r["steps"][best]["timelines"]])
            plot_schedule(
                r["schedule"],
                p,
                m,
                path,
                stages_per_rank=v,
                costs=costs,
                measured=timeline,
                title=f"{r['schedule']}: p={p}, m={m}"
                + (f", v={v}" if v > 1 else "")
                + f", planned vs measured ({ns.engine})",
            )
    return rows


# ---------------------------------------------------------------------------------------------- torch
def _mlp(layers: int, width: int) -> torch.nn.Sequential:
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        lin = nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(width, width, generator=gen) / width**0.5)
            lin.bias.zero_()
        mods += [lin, nn.GELU()]
    return nn.Sequential(*mods)


def torch_world(backend: CommunicationBackend, args: dict[str, Any]) -> list[dict[str, Any]]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from dtlab.backends import ReduceOp
    from dtlab.models import PipelineParallelModel
    from dtlab.optimizers import DDPOptimizer

    torch.set_num_threads(1)
    p, rank, m = backend.world_size, backend.rank, args["m"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args["batch"], args["width"], generator=gen)
    y = torch.randn(args["batch"], args["width"], generator=gen)
    out = []
    for schedule, v in SCHEDULES[:3]:
        stages = p * v
        per = 2 * args["layers"] // stages
        base = _mlp(args["layers"], args["width"])
        dt_model = PipelineParallelModel(
            copy.deepcopy(base),
            backend,
            schedule,
            micro_batches=m,
            stages_per_rank=v,
            split_points=[str(per * s) for s in range(1, stages)],
        )
        dt_opt = DDPOptimizer(dt_model, torch.optim.SGD, lr=0.01)

        def dtlab_step(model: PipelineParallelModel = dt_model, opt: DDPOptimizer = dt_opt) -> float:
            loss = model.train_step((x, y), F.mse_loss)
            opt.step()
            opt.zero_grad()
            return float(loss)

        mine = [s for s in range(stages) if s % p == rank]
        example = torch.empty(args["batch"] // m, args["width"])
        pipe_stages = [
            PipelineStage(
                nn.Sequential(*list(copy.deepcopy(base))[per * s : per * (s + 1)]),
                s,
                stages,
                torch.device("cpu"),
                input_args=example,
            )
            for s in mine
        ]
        params = [q for st in pipe_stages for q in st.submod.parameters()]
        t_opt = torch.optim.SGD(params, lr=0.01)
        if schedule == "gpipe":
            sched: PipelineScheduleSingle | PipelineScheduleMulti = ScheduleGPipe(
                pipe_stages[0], m, loss_fn=F.mse_loss
            )
        elif schedule == "1f1b":
            sched = Schedule1F1B(pipe_stages[0], m, loss_fn=F.mse_loss)
        else:
            sched = ScheduleInterleaved1F1B(list[Any](pipe_stages), m, loss_fn=F.mse_loss)
        first, last = 0 in mine, stages - 1 in mine

        def torch_step(
            sched: PipelineScheduleSingle | PipelineScheduleMulti = sched,
            opt: torch.optim.Optimizer = t_opt,
            first: bool = first,
            last: bool = last,
        ) -> float:
            losses: list[Any] = []
            feed = (x,) if first else ()
            sched.step(*feed, target=y if last else None, losses=losses, return_outputs=False)
            opt.step()
            opt.zero_grad()
            total = torch.tensor([float(sum(losses)) / m if last else 0.0], dtype=torch.float64)
            backend.all_reduce(total, ReduceOp.SUM)  # only the last stage's rank holds the losses
            return float(total)

        res = measure(backend, {"dtlab": dtlab_step, "torch": torch_step}, args | {"warmup": 0})
        out.append({"schedule": schedule, "v": v, **res})
    return out


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median, upper quartile (one value: itself three times, as a single round gives)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def run_torch(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Per schedule: each variant's median step and its quartiles over every timed step; the ratio of
    the medians, and the ratio within each round (dtlab's median step over torch's, the two blocks run
    back to back) with its median, quartiles and range: load drift between rounds hits both alike."""
    from dtlab.testing import spawn_world

    args = {k: getattr(ns, k) for k in ("layers", "width", "batch", "rounds", "steps")} | {"m": ns.torch_m}
    load_before = os.getloadavg()
    res = spawn_world(ns.torch_pp, torch_world, args, backend="gloo", timeout=1800)[0]
    load_after = os.getloadavg()
    rows = []
    for r in res:
        dt_all, t_all = r["times"]["dtlab"], r["times"]["torch"]
        per_round = round_ratios(dt_all, t_all, ns.steps)
        (d1, d, d3), (t1, t, t3) = _quartiles(dt_all), _quartiles(t_all)
        r1, rm, r3 = _quartiles(per_round)
        rows.append(
            {
                "schedule": r["schedule"],
                "p": ns.torch_pp,
                "m": ns.torch_m,
                "v": r["v"],
                "dtlab_ms": 1e3 * d,
                "dtlab_q1_q3_ms": f"{1e3 * d1:.1f}-{1e3 * d3:.1f}",
                "torch_ms": 1e3 * t,
                "torch_q1_q3_ms": f"{1e3 * t1:.1f}-{1e3 * t3:.1f}",
                "ratio": d / t,
                "round_ratio_median": rm,
                "round_ratio_q1_q3": f"{r1:.2f}-{r3:.2f}",
                "round_ratio_range": f"{min(per_round):.2f}-{max(per_round):.2f}",
                "dtlab_best_ms": 1e3 * min(dt_all),
                "torch_best_ms": 1e3 * min(t_all),
                "first_loss_dtlab": r["first_loss"]["dtlab"],
                "first_loss_torch": r["first_loss"]["torch"],
                "rounds": len(per_round),
                "load_before_after": f"{load_before[0]:.1f}/{load_after[0]:.1f}",
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("bubble", "torch", "all"))
    ap.add_argument("--pp", type=int, default=4, help="bubble: pipeline ranks")
    ap.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[4, 8])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-ms", type=float, default=10.0, help="sleep of each block's F, I and W")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plots", default=None, help="bubble: directory for the timeline PNGs")
    ap.add_argument("--engine", choices=("gloo", "mpi"), default="gloo", help="bubble: the backend")
    ap.add_argument("--torch-pp", type=int, default=2)
    ap.add_argument("--torch-m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    results: dict[str, Any] = {}
    if ns.what in ("bubble", "all"):
        results["bubble"] = run_bubble(ns)
        print(_table(results["bubble"]))
    if ns.what in ("torch", "all"):
        results["torch"] = run_torch(ns)
        print(_table(results["torch"]))
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
