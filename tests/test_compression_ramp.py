"""The density ramp (``ramp_steps``, Deep Gradient Compression's warm-up training): dense warm-up,
then 25%, 6.25%, ... down to ``density`` in equal stages; exact per-stage selections, Ok-Topk's
thresholds follow the stages, state and resume, bad values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import CompressedReducer, GradientSynchronizer, OkTopk, TopkA
from dtlab.compression.base import ramp_densities
from dtlab.errors import ConfigError
from dtlab.testing import run_world

N = 8000


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 1009 + step)
    return torch.randn(N, generator=g) * torch.linspace(0.1, 2.0, N)


def test_stages_and_bad_values() -> None:
    assert ramp_densities(0.01) == [0.25, 0.0625, 0.015625]
    assert ramp_densities(0.02) == [0.25, 0.0625]
    assert ramp_densities(0.25) == [] and ramp_densities(0.5) == []
    c = OkTopk(density=0.01, warmup_steps=5, ramp_steps=30)
    assert [c.at_step(s).density for s in (0, 9, 10, 19, 20, 29, 30, 1000)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01
    ]  # fmt: skip
    staged = c.at_step(0)
    assert isinstance(staged, OkTopk) and staged.tau == c.tau and staged.warmup_steps == 5
    assert TopkA(density=0.5, ramp_steps=10).at_step(0).density == 0.5  # nothing above: no stages
    assert TopkA(density=0.01).at_step(0) is not None and TopkA(density=0.01).ramp_steps == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="ramp_steps must be an integer >= 0"):
            TopkA(density=0.01, ramp_steps=bad)  # type: ignore[arg-type]


def _ramped(backend: CommunicationBackend, comp: Any, steps: int) -> list[dict[str, Any]]:
    red = CompressedReducer(backend, comp, dense_below=0)
    out = []
    for s in range(steps):
        g = _grad(backend.rank, s)
        res = red.error_feedback.residual("g")
        acc = g + (res if res is not None else 0.0)
        red.start_step()
        buf = g.clone()
        red.all_reduce("g", buf).wait()
        out.append({"acc": acc, "result": buf, "stats": red.step_statistics()})
    return out


def test_topka_follows_the_ramp_exactly() -> None:
    comp = TopkA(density=0.01, warmup_steps=2, ramp_steps=6)
    runs = run_world(2, _ramped, comp, 10)
    expected = [1.0, 1.0, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    for s, d in enumerate(expected):
        assert runs[0][s]["stats"]["local_density"] == pytest.approx(int(d * N) / N), s
        if s < 2:
            assert runs[0][s]["stats"]["dense_calls"] == 1
            continue
        # the average of each rank's exact local top-k at this stage's k
        k = int(d * N)
        want = torch.zeros(N)
        for r in runs:
            idx = torch.topk(r[s]["acc"].abs(), k).indices
            want[idx] += r[s]["acc"][idx]
        torch.testing.assert_close(runs[0][s]["result"], want / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(runs[1][s]["result"], runs[0][s]["result"], rtol=0, atol=0)


def test_oktopk_selection_tracks_each_stage() -> None:
    comp = OkTopk(density=0.01, warmup_steps=0, ramp_steps=24, tau=32, tau_prime=64)
    runs = run_world(4, _ramped, comp, 40)
    for s in range(40):
        d = comp.at_step(s).density
        got = runs[0][s]["stats"]["density"]
        # reused thresholds from a denser stage are re-evaluated by the guard, never left at 4x k
        assert d / 2 <= got <= 2 * d, (s, d, got)
        for r in runs[1:]:
            torch.testing.assert_close(r[s]["result"], runs[0][s]["result"], rtol=0, atol=0)


def _resume(backend: CommunicationBackend) -> list[torch.Tensor]:
    """Steps 0..5 in one synchronizer vs 0..2, state_dict, load into a fresh one, 3..5."""
    comp = TopkA(density=0.01, warmup_steps=1, ramp_steps=4)

    def step(sync: GradientSynchronizer, s: int) -> torch.Tensor:
        return sync.sync({"w": _grad(backend.rank, s)})["w"]

    whole = GradientSynchronizer(comp, backend)
    a = [step(whole, s) for s in range(6)]
    first = GradientSynchronizer(comp, backend)
    b = [step(first, s) for s in range(3)]
    tensors, meta = first.reducer.state_dict()
    second = GradientSynchronizer(comp, backend)
    second.reducer.load_state_dict(tensors, meta)
    b += [step(second, s) for s in range(3, 6)]
    return [torch.stack(a), torch.stack(b), torch.tensor(second.statistics["local_density"])]


def test_resume_continues_the_ramp() -> None:
    for a, b, dens in run_world(2, _resume):
        assert torch.equal(a, b)
        assert float(dens) == pytest.approx(int(0.01 * N) / N)  # step 5: past the ramp (1 + 4 steps)
