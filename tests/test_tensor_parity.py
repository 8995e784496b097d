"""Tensor parallelism's first test: the built-in transformer (vocabulary-parallel embedding and loss,
heads and MLP split, with and without sequence parallelism) trains to the same losses and parameters
as one process on the same global batch, after 5 steps of SGD-momentum and of AdamW, at tp=2, tp=4 and
dp2 x tp2 (DDPOptimizer and ZeRO1Optimizer) in memory, and at tp=2 on Gloo and MPI."""

from __future__ import annotations

import pytest
import torch
from test_tensor_helpers import OPTIMIZERS, check_parity, train_reference, train_tensor

from dtlab.testing import run_world


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    torch.set_num_threads(1)
    return {opt: train_reference(opt) for opt in OPTIMIZERS}


CASES = [
    ({"tp": 2}, False, "ddp"),
    ({"tp": 2}, True, "ddp"),
    ({"tp": 4}, False, "ddp"),
    ({"tp": 4}, True, "zero1"),
    ({"dp": 2, "tp": 2}, False, "ddp"),
    ({"dp": 2, "tp": 2}, True, "ddp"),
    ({"dp": 2, "tp": 2}, False, "zero1"),
]


@pytest.mark.parametrize(("shape", "sp", "strategy"), CASES)
def test_parity_in_memory(
    shape: dict[str, int],
    sp: bool,
    strategy: str,
    references: dict[str, tuple[list[float], dict[str, torch.Tensor]]],
) -> None:
    world = 1
    for size in shape.values():
        world *= size
    for opt in OPTIMIZERS:
        results = run_world(world, train_tensor, shape, opt, sp, strategy, timeout=60)
        check_parity(results, references[opt], f"{shape} sp={sp} {strategy}/{opt}")


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_parity_real_engines(
    backend: str, references: dict[str, tuple[list[float], dict[str, torch.Tensor]]]
) -> None:
    """Both optimizers, with and without sequence parallelism, in ONE spawned tp=2 world per engine."""
    from dtlab.testing import spawn_world

    if backend == "mpi":
        pytest.importorskip("mpi4py")
    from test_tensor_helpers import engine_world

    results = spawn_world(2, engine_world, backend=backend, timeout=240)
    for run in results[0]:
        check_parity([r[run] for r in results], references[run.split("/")[0]], f"{run} on {backend}")
