"""Parity, the first test of every strategy: DDP, ZeRO-1/2/3 and FSDP with SGD-with-momentum and AdamW
train to the same parameters as plain single-process training on the concatenated global batch."""

from __future__ import annotations

import pytest
import torch
from test_strategies_helpers import (
    OPTIMIZERS,
    STRATEGIES,
    max_rel_error,
    train_all,
    train_distributed,
    train_reference,
)

from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 5, 8


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return {opt: train_reference(opt, STEPS, GLOBAL_BATCH) for opt in OPTIMIZERS}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_in_memory(
    strategy: str, world_size: int, references: dict[str, dict[str, torch.Tensor]]
) -> None:
    for opt in OPTIMIZERS:
        states = run_world(world_size, train_distributed, strategy, opt, STEPS, GLOBAL_BATCH, timeout=30)
        for rank, state in enumerate(states):
            err = max_rel_error(state, references[opt])
            where = f"{strategy}/{opt} at {world_size} ranks, rank {rank}"
            assert err <= 1e-5, f"{where}: relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_parity_real_engines(backend: str, references: dict[str, dict[str, torch.Tensor]]) -> None:
    """All five strategies x both optimizers in ONE spawned 2-process world per engine."""
    from dtlab.testing import spawn_world

    if backend == "mpi":
        pytest.importorskip("mpi4py")
    results = spawn_world(2, train_all, STEPS, GLOBAL_BATCH, backend=backend, timeout=240)
    for rank, by_run in enumerate(results):
        assert sorted(by_run) == sorted(f"{s}/{o}" for s in STRATEGIES for o in OPTIMIZERS)
        for run, state in by_run.items():
            err = max_rel_error(state, references[run.split("/")[1]])
            assert err <= 1e-5, f"{run} on {backend}, rank {rank}: relative error {err:.2e}"


VARIANTS = [
    ("ddp", {"bucket_cap_mb": 0.0004}),  # ~400-byte buckets: several launched during backward
    ("zero1", {"bucket_cap_mb": 0.0004}),
    ("zero1", {"gradient_sync": "all_reduce"}),
    ("zero2", {"bucket_cap_mb": 0.0004}),
    ("zero3", {"persistence_threshold": 20}),  # biases kept whole, weights sharded
    ("zero3", {"prefetch": False}),
    ("fsdp", {"reshard_after_forward": False}),
    ("fsdp", {"prefetch": False, "wrap_policy": None}),
]


@pytest.mark.parametrize(("strategy", "options"), VARIANTS, ids=[f"{s}-{sorted(o)[0]}" for s, o in VARIANTS])
def test_parity_of_options(
    strategy: str, options: dict, references: dict[str, dict[str, torch.Tensor]]
) -> None:
    for opt in OPTIMIZERS:
        states = run_world(3, train_distributed, strategy, opt, STEPS, 6, timeout=30, **options)
        ref = train_reference(opt, STEPS, 6)
        for state in states:
            assert max_rel_error(state, ref) <= 1e-5, f"{strategy} {options} / {opt}"
