"""``dtlab advise`` against four published large runs: print the markdown table of
docs/strategies.md ("Checked against published runs").

For each run (``dtlab.advise.published``): the authors' plan as advise predicts it at the one FLOP
rate fitted across the four (memory per GPU, state bytes per parameter, step time against the
published one), its place among the plans that fit with the authors' checkpointing and among all
plans, and advise's fastest plan in each case with the predicted difference. Run::

    python -m dtlab.benchmarks.advise_published
"""

from __future__ import annotations

import time
from dataclasses import replace

from dtlab.advise import Limits, Prediction, advise
from dtlab.advise.plan import place
from dtlab.advise.predict import Memo
from dtlab.advise.published import PUBLISHED, fit_rate


def _mem(p: Prediction) -> str:
    return f"{p.memory.total / 2**30:.1f}"


def _plan(p: Prediction) -> str:
    return f"{p.candidate.label} (mb {p.micro_batch})"


def main() -> None:
    t0 = time.perf_counter()
    memos = [Memo() for _ in PUBLISHED]  # each run's model laid out once, for the fit and the searches
    rate = fit_rate(memos=memos)
    print(f"fitted rate: {rate:.1f} TFLOP/s per GPU on large matrix products\n")
    head = [
        "run",
        "authors' plan",
        "mem GiB",
        "state B/param",
        "published s/step",
        "advise s/step",
        "error",
        "place (same ckpt)",
        "place (all)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    others = []
    for run, memo in zip(PUBLISHED, memos, strict=True):
        p = run.predict(rate, memo=memo)
        c = p.candidate
        state = sum(s.parameters + s.gradients + s.optimizer_state for s in p.stage_memory)
        params = run.spec.parameters / c.tp
        cluster = replace(run.cluster, tflops=rate)
        same = advise(run.spec, cluster, run.global_batch, precision=run.precision,
                      limits=Limits(checkpointing=(c.checkpointing,)), memo=memo).plans  # fmt: skip
        every = advise(run.spec, cluster, run.global_batch, precision=run.precision, memo=memo).plans
        err = p.step_seconds / run.published_seconds - 1
        lines.append(
            f"| {run.name} | {_plan(p)} | {_mem(p)} | {state / params:.2f} | "
            f"{run.published_seconds:.1f} | {p.step_seconds:.1f} | {100 * err:+.0f}% | "
            f"{place(p, same)} of {len(same)} | {place(p, every)} of {len(every)} |"
        )
        for what, plans in (("same checkpointing", same), ("all plans", every)):
            b = plans[0]
            others.append(
                f"- {run.name}, fastest ({what}): {_plan(b)}, {b.step_seconds:.1f} s "
                f"({100 * (b.step_seconds / p.step_seconds - 1):+.0f}% against the authors' plan), "
                f"{_mem(b)} GiB, bubble {100 * b.bubble:.0f}%, waits dp {b.axes['dp'].exposed:.2f} s, "
                f"tp {b.axes['tp'].exposed:.2f} s, pp {b.axes['pp'].exposed:.2f} s; authors' plan: "
                f"bubble {100 * p.bubble:.0f}%, waits dp {p.axes['dp'].exposed:.2f} s, "
                f"tp {p.axes['tp'].exposed:.2f} s, pp {p.axes['pp'].exposed:.2f} s"
            )
    print("\n".join(lines))
    print()
    print("\n".join(others))
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
