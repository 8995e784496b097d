"""The hybrid strategy's first test: pipeline x data x tensor parallelism trains the built-in transformer
to the same losses and parameters as one process on the same global batch (relative error <= 1e-5 after
5 steps), for every data-parallel strategy on the dp axis, SGD-momentum and AdamW, on 8 in-memory ranks
(2 x 2 x 2), and on 4 processes over Gloo and MPI (tp2 x pp2 and dp2 x tp2; on Gloo also torch's own
2-D composite, FSDP2 over DTensor TP, against dtlab's FSDP x TP step by step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hybrid_cases import train_hybrid
from test_tensor_helpers import OPTIMIZERS, Reference, check_parity, train_reference

from dtlab.testing import run_world

CUBE = {"pp": 2, "dp": 2, "tp": 2}


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    torch.set_num_threads(1)
    return {opt: train_reference(opt) for opt in OPTIMIZERS}


def _world(shape: dict[str, int]) -> int:
    n = 1
    for size in shape.values():
        n *= size
    return n


@pytest.mark.parametrize("data_parallel", ["ddp", "zero2", "fsdp"])
def test_cube_parity_both_optimizers(data_parallel: str, references: dict[str, Reference]) -> None:
    """2 x 2 x 2: SGD-momentum with sequence parallelism, AdamW without, 1F1B with 2 micro-batches."""
    for opt, sp in (("sgd", True), ("adamw", False)):
        results = run_world(8, train_hybrid, CUBE, data_parallel, opt, sp, micro_batches=2, timeout=120)
        check_parity(results, references[opt], f"2x2x2 {data_parallel}/{opt} sp={sp}")


CASES: list[tuple[dict[str, int], str, dict[str, Any]]] = [
    (CUBE, "zero1", {"micro_batches": 2}),
    (CUBE, "zero3", {"micro_batches": 2}),
    (CUBE, "ddp", {"schedule": "gpipe", "micro_batches": 2}),
    (CUBE, "zero2", {"schedule": "interleaved_1f1b", "micro_batches": 2, "stages_per_rank": 2}),
    (CUBE, "fsdp", {"schedule": "zero_bubble", "micro_batches": 2}),
    ({"dp": 2, "tp": 2}, "fsdp", {}),  # no pipeline: the strategy's own reduction during backward
    ({"pp": 4, "tp": 2}, "zero3", {"micro_batches": 4}),
    # each stage checkpointed: recomputed in its backward, under sharded and whole parameters
    (CUBE, "fsdp", {"micro_batches": 2, "activation_checkpointing": True}),
    (CUBE, "ddp", {"schedule": "gpipe", "micro_batches": 2, "activation_checkpointing": True}),
]


@pytest.mark.parametrize(("shape", "data_parallel", "pipeline"), CASES)
def test_parity_other_strategies_schedules_and_meshes(
    shape: dict[str, int], data_parallel: str, pipeline: dict[str, Any], references: dict[str, Reference]
) -> None:
    results = run_world(
        _world(shape), train_hybrid, shape, data_parallel, "sgd", True, timeout=120, **pipeline
    )
    check_parity(results, references["sgd"], f"{shape} {data_parallel} {pipeline}")


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_parity_on_real_engines(backend: str, references: dict[str, Reference]) -> None:
    """tp2 x pp2 and dp2 x tp2 in ONE spawned 4-process world per engine."""
    from dtlab.testing import spawn_world

    if backend == "mpi":
        pytest.importorskip("mpi4py")
    from hybrid_cases import engine_world

    results = spawn_world(4, engine_world, backend=backend, timeout=300)
    for run in results[0]:
        check_parity([r[run] for r in results], references[run.split("/")[0]], f"{run} on {backend}")
    if backend == "gloo":  # dtlab's FSDP x TP and torch's FSDP2 x DTensor TP, step by step
        ours, theirs = results[0]["adamw/dp2xtp2/fsdp"][0], results[0]["adamw/dp2xtp2/torch_2d"][0]
        err = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
        assert err <= 1e-12, (
            f"dtlab dp2 x tp2 FSDP against torch's 2-D composite: loss relative error {err:.2e}"
        )
