"""The Trainer on a mesh (``parallel.tp`` / ``parallel.pp``): the embedded transformer trains to the same
losses as data parallelism alone on the same dp split of the global batch (the model-parallel
strategies run ``model.train_step``, sample by dp rank and average the loss over dp)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from dtlab.cli import main
from dtlab.config import load_config
from dtlab.errors import ConfigError
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training
from dtlab.trainers.models import TransformerLM

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=4",
    "data.shuffle=false",
    "optimizer.warmup_steps=1",
    "train.steps=3",
    "train.eval_every=3",
    "logging.progress=false",
    "logging.run_dir=null",
]


def _run(*overrides: str) -> tuple[list[float], float, Any]:
    results = run_training(load_config(overrides=[*TINY, *overrides]))
    losses = [v for _, v in results[0].losses]
    for r in results[1:]:  # every rank reports the same dp-averaged loss and evaluation
        assert [v for _, v in r.losses] == losses and r.evals == results[0].evals
    return losses, results[0].evals[-1][1]["eval_loss"], results[0].summary


def test_tensor_and_pipeline_meshes_train_like_data_parallel() -> None:
    ref, ref_eval, _ = _run("backend.world_size=2")
    runs = {
        "tp2": _run("backend.world_size=4", "parallel.tp=2", "parallel.sequence_parallel=true"),
        "pp2": _run("backend.world_size=4", "parallel.pp=2", "parallel.micro_batches=4"),
        "tensor zero1": _run("backend.world_size=4", "parallel.tp=2", "strategy.model=zero1"),
    }
    for name, (losses, ev, summary) in runs.items():
        assert losses == pytest.approx(ref, rel=1e-5), name
        assert ev == pytest.approx(ref_eval, rel=1e-5), name
        assert "dp 2" in summary["mesh"], (name, summary["mesh"])


def test_dtlab_train_on_a_cube_resumes_at_another_mesh_and_consolidates(tmp_path: Path) -> None:
    """``dtlab train`` at 2 x 2 x 2 (FSDP on dp, sequence parallel) trains like DDP on the dp split;
    its step-2 checkpoint resumes at pp=4 under DDP with the uninterrupted step-3 loss, and
    ``dtlab consolidate`` writes the plain model."""
    ck = tmp_path / "ck"
    cube = ["backend.world_size=8", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    saved = [
        *cube,
        "strategy.model=fsdp",
        "checkpoint.every=2",
        f"checkpoint.dir={ck}",
        "checkpoint.keep_last=3",
    ]
    losses, _, summary = _run(*saved)
    assert summary["mesh"] == "pp 2 x dp 2 x tp 2 (hybrid)"
    ref, _, _ = _run("backend.world_size=2")
    assert losses == pytest.approx(ref, rel=1e-5)
    step2 = ck / "step_00000002"
    resumed = run_training(
        load_config(
            overrides=[
                *TINY,
                "backend.world_size=4",
                "parallel.pp=4",
                "parallel.micro_batches=4",
                f"checkpoint.resume={step2}",
            ]
        )
    )[0]
    assert resumed.start_step == 2 and [s for s, _ in resumed.losses] == [3]
    assert resumed.losses[0][1] == pytest.approx(losses[2], rel=1e-5)
    out = tmp_path / "plain.safetensors"
    assert main(["consolidate", str(step2), "-o", str(out)]) == 0
    net = TransformerLM(d_model=32, n_layers=4, n_heads=2, seq_len=32)
    net.load_state_dict(load_file(str(out)))  # strict: every tensor of the plain model, whole


def test_mixed_precision_on_a_mesh_trains_and_evaluates() -> None:
    """bf16 and fp16 autocast on 2 x 2 (tp x pp): the logits that cross the pipeline for evaluation
    and every activation between stages travel in the boundary's dtype on both sides; the losses stay
    close to fp32's."""
    mesh = ["backend.world_size=4", "parallel.tp=2", "parallel.pp=2"]
    ref, ref_eval, _ = _run(*mesh)
    for precision in ("bf16", "fp16"):
        losses, eval_loss, _ = _run(*mesh, f"train.precision={precision}")
        assert losses == pytest.approx(ref, rel=2e-2), precision
        assert eval_loss == pytest.approx(ref_eval, rel=2e-2), precision


def test_activation_checkpointing_on_a_mesh_trains_like_without() -> None:
    """Per pipeline stage (pp) and per block with its collectives recomputed (tp): the same losses."""
    for mesh in (
        ["parallel.pp=2", "parallel.micro_batches=4"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ):
        ref, ref_eval, _ = _run("backend.world_size=4", *mesh)
        losses, eval_loss, _ = _run("backend.world_size=4", *mesh, "strategy.activation_checkpointing=true")
        assert losses == pytest.approx(ref, rel=1e-5), mesh
        assert eval_loss == pytest.approx(ref_eval, rel=1e-5), mesh
    with pytest.raises(ConfigError, match=r"parallel\.schedule='zero_bubble'"):
        load_config(
            overrides=[
                *TINY,
                "parallel.pp=2",
                "parallel.schedule=zero_bubble",
                "strategy.activation_checkpointing=true",
            ]
        )


def test_reduce_dtype_reaches_the_tensor_and_pipeline_strategies() -> None:
    """``strategy.reduce_dtype`` is the dp reducer's dtype under every model strategy of a mesh."""
    import torch

    from dtlab.testing import run_world
    from dtlab.trainers.build import build_model_strategy
    from dtlab.trainers.tasks import build_task

    for model, axis in (("zero1", "parallel.tp=2"), ("ddp", "parallel.pp=2")):
        config = load_config(
            overrides=[
                *TINY,
                "backend.world_size=4",
                axis,
                f"strategy.model={model}",
                "strategy.reduce_dtype=bf16",
            ]
        )
        task = build_task(config)

        def body(backend: Any, config: Any = config, task: Any = task) -> Any:
            strategy, _ = build_model_strategy(config, backend, task)
            return strategy.gradient_reducer.reduce_dtype  # type: ignore[attr-defined]

        assert run_world(4, body, timeout=60) == [torch.bfloat16] * 4, model
