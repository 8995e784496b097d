"""Model-parallel parity with plain SGD (no momentum: every update is the gradient itself, so a
gradient off by a constant factor fails here): pipelines with several micro-batches (their
accumulation), alone and with dp, and the hybrid strategy (pp x dp x tp, dp x tp) under sharded
data-parallel strategies, against one process on the whole batch. The tensor-parallel and data-parallel
parity tests run plain SGD among their optimizers (``sgd_plain``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybrid_cases import train_hybrid
from pipeline_cases import MODELS, pipeline_rank, reference, worst_error
from test_tensor_helpers import max_rel_error, train_reference

from dtlab.testing import run_world

TOL = 1e-5
BATCH = 8

PIPELINES: list[tuple[str, dict[str, int], str, int, int, bool]] = [
    # kind, mesh, schedule, micro-batches, stages per rank, ZeRO-1
    ("mlp", {"pp": 2}, "1f1b", 4, 1, False),
    ("mlp", {"pp": 2}, "interleaved_1f1b", 4, 2, False),
    ("mlp", {"pp": 2, "dp": 2}, "gpipe", 4, 1, True),
    ("lm", {"pp": 2}, "zero_bubble", 4, 1, False),
]


@pytest.mark.parametrize(("kind", "mesh", "schedule", "m", "v", "zero1"), PIPELINES)
def test_pipeline_micro_batches_keep_the_gradient_scale(
    kind: str, mesh: dict[str, int], schedule: str, m: int, v: int, zero1: bool
) -> None:
    torch.set_num_threads(1)
    ref = reference(kind, "sgd_plain", BATCH)
    start = MODELS[kind][0]().state_dict()
    assert max_rel_error(start, ref[1]) > 100 * TOL  # the steps move the parameters far beyond TOL
    world = 1
    for size in mesh.values():
        world *= size
    results = run_world(
        world, pipeline_rank, kind, mesh, schedule, m, "sgd_plain", BATCH, v, zero1, timeout=60
    )
    assert worst_error(results, ref) <= TOL, (kind, mesh, schedule, m)


HYBRID: list[tuple[dict[str, int], str, dict[str, Any]]] = [
    ({"pp": 2, "dp": 2, "tp": 2}, "zero2", {"micro_batches": 2}),
    ({"pp": 2, "dp": 2, "tp": 2}, "fsdp", {"schedule": "zero_bubble", "micro_batches": 2}),
    ({"dp": 2, "tp": 2}, "zero3", {}),
]


@pytest.mark.parametrize(("shape", "data_parallel", "pipeline"), HYBRID)
def test_hybrid_keeps_the_gradient_scale(
    shape: dict[str, int], data_parallel: str, pipeline: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    ref_losses, ref_state = train_reference("sgd_plain")
    world = 1
    for size in shape.values():
        world *= size
    results = run_world(world, train_hybrid, shape, data_parallel, "sgd_plain", True, timeout=120, **pipeline)
    for rank, (losses, state) in enumerate(results):
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        err = max_rel_error(state, ref_state)
        where = f"{shape} {data_parallel} {pipeline}, rank {rank}"
        assert loss_err <= TOL and err <= TOL, f"{where}: losses {loss_err:.2e}, parameters {err:.2e}"
