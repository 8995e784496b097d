"""``dtlab advise`` against four published large runs (BLOOM-176B, OPT-175B, GPT-NeoX-20B,
MT-NLG 530B; ``dtlab.advise.published``): at one FLOP rate fitted across them, each authors' plan
fits on their GPUs, keeps the state per parameter its precision policy implies, takes within 25% of
the published step time, and ranks among the best plans with the authors' checkpointing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtlab.advise import Limits, advise
from dtlab.advise.plan import place
from dtlab.advise.predict import Memo
from dtlab.advise.published import PUBLISHED, fit_rate, megatron_flops


def test_megatron_formula_gives_mt_nlg_iteration_time() -> None:
    mt = next(r for r in PUBLISHED if r.name.startswith("MT-NLG"))
    assert megatron_flops(mt.spec, 1920) / (2240 * 126e12) == pytest.approx(60.1, rel=0.01)  # paper: 60.1 s


def test_published_runs_at_one_fitted_rate() -> None:
    memos = [Memo() for _ in PUBLISHED]  # each run's model laid out once, for the fit and the search
    rate = fit_rate(memos=memos)
    assert 100 < rate < 312  # below the A100's bf16 peak
    for run, memo in zip(PUBLISHED, memos, strict=True):
        c = run.candidate()
        p = run.predict(rate, memo=memo)
        assert p.fits, (run.name, p.problems)
        assert 0.75 < p.step_seconds / run.published_seconds < 1.25, run.name
        m = p.memory
        local = sum(m.parameters for m in p.stage_memory)  # the tp rank's share of the whole model
        state = sum(s.parameters + s.gradients + s.optimizer_state for s in p.stage_memory)
        prec = run.precision
        per_param = {
            "zero1": prec.params + prec.grads + (2 * prec.states + prec.master) / c.dp,
            "fsdp": (prec.params + prec.grads + 2 * prec.states + prec.master) / c.dp,
        }[c.strategy]
        held = local / (prec.params if c.strategy == "zero1" else prec.params / c.dp)
        assert state / held == pytest.approx(per_param, rel=0.02), run.name
        assert m.total < run.cluster.memory_bytes
        best = advise(
            run.spec,
            replace(run.cluster, tflops=rate),
            run.global_batch,
            precision=run.precision,
            limits=Limits(checkpointing=("block",)),
            memo=memo,
        ).plans
        assert place(p, best) <= len(best) / 3, run.name
        assert p.step_seconds < 1.2 * best[0].step_seconds, run.name
