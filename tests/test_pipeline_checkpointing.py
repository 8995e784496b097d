"""Activation checkpointing per pipeline stage: each stage keeps only its input per micro-batch and
recomputes its forward in its backward. Same losses and parameters as one process (the parity bar),
fewer activation bytes held than without, and zero-bubble refused with the reason."""

from __future__ import annotations

import pytest
from pipeline_cases import make_lm, pipeline_rank, reference, worst_error
from refusals import refusal_messages

from dtlab.backends import Mesh
from dtlab.models import HybridShardedModel, PipelineParallelModel
from dtlab.testing import run_world


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"), [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2)]
)
def test_checkpointed_stages_train_like_one_process_and_hold_less(
    schedule: str, pp: int, m: int, v: int
) -> None:
    ref = reference("lm", "adamw", 8)
    plain = run_world(pp, pipeline_rank, "lm", {"pp": pp}, schedule, m, "adamw", 8, v, timeout=120)
    ckpt = run_world(
        pp, pipeline_rank, "lm", {"pp": pp}, schedule, m, "adamw", 8, v, checkpointing=True, timeout=120
    )
    assert worst_error(ckpt, ref) <= 1e-5, schedule
    for rank, (a, b) in enumerate(zip(plain, ckpt, strict=True)):
        held, held_ckpt = a["memory"]["activations"], b["memory"]["activations"]
        assert 0 < held_ckpt < held, (schedule, rank, held_ckpt, held)


def _refusals(backend: object) -> list[str]:
    def zero_bubble() -> object:
        pp, checkpointed = Mesh(backend, {"pp": 2}), {"activation_checkpointing": True}
        return PipelineParallelModel(make_lm(), pp, "zero_bubble", micro_batches=2, **checkpointed)

    def no_pipeline() -> object:
        return HybridShardedModel(make_lm(), Mesh(backend, {"dp": 2}), "ddp", activation_checkpointing=True)

    return refusal_messages([zero_bubble, no_pipeline])


def test_zero_bubble_and_no_pipeline_are_refused_with_the_fix() -> None:
    errors = run_world(2, _refusals, timeout=60)[0]
    assert len(errors) == 2, errors
    assert "use gpipe, 1f1b or interleaved_1f1b with checkpointing" in errors[0]
    assert "checkpoint_modules(module" in errors[1]
