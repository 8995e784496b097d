"""Pipeline parity: losses and every parameter after 5 steps of SGD-momentum and AdamW equal one
process on the global batch (relative error <= 1e-5), for every schedule, pp = 2 and 4, m = 4 and 8,
interleaved with v = 2, dp2 x pp2, in memory; pp = 2 on gloo and MPI (one spawned world per engine)."""

from __future__ import annotations

from typing import Any

import pytest
from pipeline_cases import pipeline_rank, reference, worst_error

from dtlab.backends import Mesh
from dtlab.testing import run_world, spawn_world

TOL = 1e-5
BATCH = 16

GRID = [
    (schedule, pp, m, 2 if schedule == "interleaved_1f1b" else 1)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
    for pp in (2, 4)
    for m in (4, 8)
]


@pytest.fixture(scope="module")
def refs() -> dict[tuple[str, str, int], Any]:
    return {
        (k, o, b): reference(k, o, b) for k in ("mlp", "lm") for o in ("sgd", "adamw") for b in (BATCH, 8)
    }


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), GRID)
def test_parity_in_memory(schedule: str, pp: int, m: int, v: int, refs: dict) -> None:
    for opt, zero1 in (("sgd", False), ("adamw", True)):
        results = run_world(
            pp, pipeline_rank, "mlp", {"pp": pp}, schedule, m, opt, BATCH, v, zero1, timeout=60
        )
        assert worst_error(results, refs[("mlp", opt, BATCH)]) <= TOL, (schedule, pp, m, v, opt)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_parity_dp2_x_pp2_in_memory(schedule: str, refs: dict) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    for opt, zero1 in (("sgd", True), ("adamw", False)):
        results = run_world(
            4, pipeline_rank, "mlp", {"pp": 2, "dp": 2}, schedule, 4, opt, BATCH, v, zero1, timeout=60
        )
        assert worst_error(results, refs[("mlp", opt, BATCH)]) <= TOL, (schedule, opt)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_parity_transformer_lm(schedule: str, refs: dict) -> None:
    """The built-in TransformerLM through its pipeline_blocks() adapter (embedding, blocks, head):
    attention, layer norms and embeddings, and zero-bubble's split of every linear layer."""
    pp, v = (2, 2) if schedule == "interleaved_1f1b" else (4, 1)
    for opt in ("sgd", "adamw"):
        results = run_world(pp, pipeline_rank, "lm", {"pp": pp}, schedule, 4, opt, 8, v, timeout=60)
        assert worst_error(results, refs[("lm", opt, 8)]) <= TOL, (schedule, opt)


def engine_world(backend: Any) -> list[dict[str, Any]]:
    """Everything one spawned pp=2 world checks: each schedule, SGD-momentum and AdamW in turn."""
    mesh = Mesh(backend, {"pp": 2})
    out = []
    for schedule, v, opt in (
        ("gpipe", 1, "sgd"),
        ("1f1b", 1, "adamw"),
        ("interleaved_1f1b", 2, "sgd"),
        ("zero_bubble", 1, "adamw"),
    ):
        r = pipeline_rank(mesh, "mlp", {"pp": 2}, schedule, 4, opt, BATCH, v, opt == "adamw")
        r.update(schedule=schedule, opt=opt)
        out.append(r)
    return out


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_parity_on_engine(engine: str, refs: dict) -> None:
    per_rank = spawn_world(2, engine_world, backend=engine, timeout=240)
    for runs in zip(*per_rank, strict=True):
        opt = runs[0]["opt"]
        assert worst_error(list(runs), refs[("mlp", opt, BATCH)]) <= TOL, (engine, runs[0]["schedule"], opt)
