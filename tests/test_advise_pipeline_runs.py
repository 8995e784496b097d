"""``dtlab advise`` against pipeline runs of the embedded transformer on in-memory ranks: each stage's
predicted memory, activations and bytes per axis equal what the strategies report and the backends count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_advise_runs import TP_BATCH, _largest_state, _same_memory

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, predict
from dtlab.testing import run_world


def _pipeline_steps(backend: Any, spec: ModelSpec, plan: Candidate) -> dict[str, Any]:
    from dtlab.backends import Mesh
    from dtlab.models import PipelineParallelModel
    from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
    from dtlab.trainers.models import TransformerLM

    mesh = Mesh(backend, {"pp": plan.pp, "dp": plan.dp})
    with torch.random.fork_rng(devices=[]):
        net = TransformerLM(spec.hidden, spec.layers, spec.heads, spec.seq_len)
    model = PipelineParallelModel(
        net,
        mesh,
        plan.schedule,
        micro_batches=plan.micro_batches,
        stages_per_rank=plan.stages_per_rank,
        activation_checkpointing=plan.checkpointing == "stage",
    )
    opt = (DDPOptimizer if plan.strategy == "ddp" else ZeRO1Optimizer)(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(100 + mesh.coordinate("dp"))
    local = TP_BATCH // plan.dp
    for step in range(2):
        x = torch.randint(0, 256, (local, spec.seq_len), generator=g)
        y = torch.randint(0, 256, (local, spec.seq_len), generator=g)
        if step == 1:
            for axis in ("dp", "pp"):
                mesh[axis].stats.reset()
        model.train_step((x, y), model.cross_entropy)  # dtlab train's loss on a mesh
        opt.step()
        opt.zero_grad()
    return {
        "memory": opt.memory_report(),
        "ops": {
            axis: {
                k: (v["calls"], v["bytes_sent"])
                for k, v in mesh[axis].stats.snapshot().items()
                if v["bytes_sent"]
            }
            for axis in ("dp", "pp")
        },
    }


PP_SPEC = ModelSpec.builtin(d_model=32, n_layers=2, n_heads=2, seq_len=16)
PP_PLANS = [
    (PP_SPEC, Candidate("ddp", pp=2, schedule="1f1b", micro_batches=2)),
    (PP_SPEC, Candidate("zero1", pp=2, schedule="gpipe", micro_batches=4)),
    (PP_SPEC, Candidate("ddp", pp=2, schedule="zero_bubble", micro_batches=4)),
    (PP_SPEC, Candidate("zero1", dp=2, pp=2, schedule="1f1b", micro_batches=2)),
    (
        ModelSpec.builtin(d_model=32, n_layers=4, n_heads=2, seq_len=16),
        Candidate("ddp", pp=2, schedule="interleaved_1f1b", micro_batches=2, stages_per_rank=2),
    ),
    # stage checkpointing, as dtlab's pipeline does it: each in-flight micro-batch keeps its stage's
    # input and output (and the loss's share); the working set is rebuilt once, not per micro-batch
    (PP_SPEC, Candidate("ddp", pp=2, schedule="1f1b", micro_batches=2, checkpointing="stage")),
    (PP_SPEC, Candidate("zero1", pp=2, schedule="gpipe", micro_batches=4, checkpointing="stage")),
    (PP_SPEC, Candidate("zero1", dp=2, pp=2, schedule="1f1b", micro_batches=2, checkpointing="stage")),
    (
        ModelSpec.builtin(d_model=32, n_layers=4, n_heads=2, seq_len=16),
        Candidate(
            "ddp",
            pp=2,
            schedule="interleaved_1f1b",
            micro_batches=2,
            stages_per_rank=2,
            checkpointing="stage",
        ),
    ),
]


@pytest.mark.parametrize(("spec", "plan"), PP_PLANS, ids=[p.label for _, p in PP_PLANS])
def test_pipeline_memory_activations_and_bytes_equal_the_run(spec: ModelSpec, plan: Candidate) -> None:
    measured = run_world(plan.ranks, _pipeline_steps, spec, plan)
    pred = predict(spec, ClusterSpec(ranks=plan.ranks), plan, TP_BATCH)
    assert pred.fits, pred.problems
    for world_rank, got in enumerate(measured):
        r = world_rank // plan.dp  # the pp coordinate (pp is the outer axis)
        mem = pred.stage_memory[r]
        want = {
            "parameters": mem.parameters,
            "gradients": mem.gradients,
            "optimizer_state": mem.optimizer_state,
            "peak_gathered_parameters": mem.parameters,
            "activations": mem.activations,
        }
        assert _same_memory(got["memory"], want) == _same_memory(want, want), f"rank {world_rank}"
        stage = measured[r * plan.dp : (r + 1) * plan.dp]
        assert _largest_state(stage) == mem.optimizer_state, f"stage {r}"
        ops = pred.stage_ops[r]
        assert got["ops"]["pp"] == {k: v for k, v in ops["pp"].items() if v[1]}, f"rank {world_rank}"
        assert got["ops"]["dp"] == ops["dp"], f"rank {world_rank}"
