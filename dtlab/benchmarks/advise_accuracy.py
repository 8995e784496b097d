"""``dtlab advise``'s predictions next to dtlab's own runs; print a markdown table.

    .venv/bin/python -m dtlab.benchmarks.advise_accuracy            # the embedded transformer, tiny sizes

For every plan of the grid it runs two steps of the embedded transformer (AdamW, 2 blocks, width 32,
16 tokens, global batch 8) on in-memory ranks and prints, per plan, the predicted and the measured
bytes of rank 0: parameters, gradients and optimizer state from ``memory_report()``, activations as
the bytes autograd saved during the second step's forward (``saved_tensors_hooks``, distinct
storages, parameters and the batch left out; not measured under ZeRO-3/FSDP), and the bytes sent
per mesh axis during the second step, from
``backend.stats``. The data-parallel strategies are built as ``dtlab train`` builds them; tensor
parallelism with ``TensorParallelModel(module, mesh, plan=transformer_plan())``; pipelines with
``PipelineParallelModel(module, mesh, schedule, micro_batches=m)`` (one row per pipeline rank; their
activations are the model's own ``memory_report()["activations"]``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, predict
from dtlab.backends import CommunicationBackend, Mesh
from dtlab.config import TrainConfig, load_config
from dtlab.core import pairs
from dtlab.models import ModelStrategy, PipelineParallelModel, TensorParallelModel, transformer_plan
from dtlab.optimizers import DDPOptimizer, OptimizerStrategy, ZeRO1Optimizer
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers.build import build_model_strategy, build_optimizer_strategy
from dtlab.trainers.models import TransformerLM
from dtlab.trainers.tasks import Task, build_task, cross_entropy_loss

SIZES = ["model.n_layers=2", "model.seq_len=16", "data.global_batch_size=8", "optimizer.name=adamw"]
SPEC = ModelSpec.builtin(d_model=32, n_layers=2, n_heads=2, seq_len=16)
TP_SPEC = ModelSpec.builtin(d_model=32, n_layers=2, n_heads=4, seq_len=16)
PP_SPEC = ModelSpec.builtin(d_model=32, n_layers=2, n_heads=2, seq_len=16)
PP4_SPEC = ModelSpec.builtin(d_model=32, n_layers=4, n_heads=2, seq_len=16)
BATCH = 8
PIPELINES = [
    (PP_SPEC, Candidate("ddp", pp=2, schedule="1f1b", micro_batches=2)),
    (PP_SPEC, Candidate("zero1", pp=2, schedule="gpipe", micro_batches=4)),
    (PP_SPEC, Candidate("ddp", pp=2, schedule="zero_bubble", micro_batches=4)),
    (PP_SPEC, Candidate("zero1", dp=2, pp=2, schedule="1f1b", micro_batches=2)),
    (PP4_SPEC, Candidate("ddp", pp=2, schedule="interleaved_1f1b", micro_batches=2, stages_per_rank=2)),
]


class SavedBytes:
    """Bytes autograd keeps for the backward: distinct storages; the parameters' and the batch's left
    out (as the pipeline's own meter does)."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in excluded if p.numel()}
        self._seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() and t.untyped_storage().data_ptr() not in self._params:
            self._seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def _two_steps(
    model: ModelStrategy,
    opt: OptimizerStrategy,
    loss_fn: Callable[..., torch.Tensor],
    groups: dict[str, CommunicationBackend],
    dp: CommunicationBackend,
    seq: int,
) -> dict[str, Any]:
    """Two steps on this replica's share of the batch; the second one is measured."""
    g = torch.Generator().manual_seed(100 + dp.rank)
    local = BATCH // dp.world_size
    hooks = model.strategy_name not in ("zero3", "fsdp")
    acts = None
    for step in range(2):
        x = torch.randint(0, 256, (local, seq), generator=g)
        y = torch.randint(0, 256, (local, seq), generator=g)
        if step == 1:
            for group in groups.values():
                group.stats.reset()
        if step == 1 and hooks:
            saved = SavedBytes([*model.parameters(), x, y])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = loss_fn(model(x), y)
            acts = saved.total
        else:
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    sent = {axis: group.stats.bytes_sent for axis, group in groups.items()}
    return {"memory": opt.memory_report(), "bytes": sent, "activations": acts}


def _data_parallel(backend: CommunicationBackend, config: TrainConfig, task: Task) -> dict[str, Any]:
    model, _ = build_model_strategy(config, backend, task)
    opt = build_optimizer_strategy(config, model)
    return _two_steps(model, opt, cross_entropy_loss, {"dp": backend}, backend, config.model.seq_len)


def _tensor_parallel(backend: CommunicationBackend, shape: dict[str, int], strategy: str) -> dict[str, Any]:
    mesh = Mesh(backend, shape)
    s = TP_SPEC
    with torch.random.fork_rng(devices=[]):
        net = TransformerLM(s.hidden, s.layers, s.heads, s.seq_len)
    model = TensorParallelModel(net, mesh, plan=transformer_plan())
    opt = (DDPOptimizer if strategy == "ddp" else ZeRO1Optimizer)(model, torch.optim.AdamW, lr=1e-3)
    groups = {"dp": mesh["dp"], "tp": mesh["tp"]}
    return _two_steps(model, opt, model.cross_entropy, groups, mesh["dp"], s.seq_len)


def _pipeline(backend: CommunicationBackend, spec: ModelSpec, plan: Candidate) -> dict[str, Any]:
    mesh = Mesh(backend, {"pp": plan.pp, "dp": plan.dp})
    with torch.random.fork_rng(devices=[]):
        net = TransformerLM(spec.hidden, spec.layers, spec.heads, spec.seq_len)
    model = PipelineParallelModel(
        net, mesh, plan.schedule, micro_batches=plan.micro_batches, stages_per_rank=plan.stages_per_rank
    )
    opt = (DDPOptimizer if plan.strategy == "ddp" else ZeRO1Optimizer)(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(100 + mesh.coordinate("dp"))
    for step in range(2):
        x = torch.randint(0, 256, (BATCH // plan.dp, spec.seq_len), generator=g)
        y = torch.randint(0, 256, (BATCH // plan.dp, spec.seq_len), generator=g)
        if step == 1:
            for axis in ("dp", "pp"):
                mesh[axis].stats.reset()
        model.train_step((x, y), cross_entropy_loss)
        opt.step()
        opt.zero_grad()
    memory = opt.memory_report()
    sent = {axis: mesh[axis].stats.bytes_sent for axis in ("dp", "pp")}
    return {"memory": memory, "bytes": sent, "activations": memory["activations"]}


def _cell(pred: int, got: int | None) -> str:
    if got is None:
        return f"{pred:,} / -"
    if pred == got:
        return f"{pred:,} / {got:,}"
    return f"{pred:,} / {got:,} ({(pred - got) / got * 100:+.1f}%)" if got else f"{pred:,} / 0"


def _row(plan: Candidate, spec: ModelSpec, got: dict[str, Any], r: int = 0) -> list[str]:
    p = predict(spec, ClusterSpec(ranks=plan.ranks), plan, BATCH)
    mem, want, ops = got["memory"], p.stage_memory[r], p.stage_ops[r]
    return [
        plan.label + (f" (pp rank {r})" if plan.pp > 1 else ""),
        _cell(want.parameters, mem["parameters"]),
        _cell(want.gradients, mem["gradients"]),
        _cell(want.optimizer_state, mem["optimizer_state"]),
        _cell(want.activations, got["activations"]),
        *(
            _cell(sum(b for k, (_, b) in ops[a].items() if k != "recv"), got["bytes"][a])
            if a in got["bytes"]
            else "-"
            for a in ("dp", "tp", "pp")
        ),
    ]


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    rows: list[list[str]] = []
    for world in (2, 4):
        for strategy in pairs.DATA_PARALLEL:
            config = load_config(
                overrides=[*TINY_LM, *SIZES, f"strategy.model={strategy}", f"backend.world_size={world}"]
            )
            got = run_world(world, _data_parallel, config, build_task(config))[0]
            rows.append(_row(Candidate(strategy, dp=world), SPEC, got))  # type: ignore[arg-type]
    for shape in ({"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}):
        for strategy in ("ddp", "zero1"):
            world = shape.get("dp", 1) * shape["tp"]
            got = run_world(world, _tensor_parallel, shape, strategy)[0]
            plan = Candidate(strategy, dp=shape.get("dp", 1), tp=shape["tp"])  # type: ignore[arg-type]
            rows.append(_row(plan, TP_SPEC, got))
    for spec, plan in PIPELINES:
        results = run_world(plan.ranks, _pipeline, spec, plan)
        for r in range(plan.pp):
            rows.append(_row(plan, spec, results[r * plan.dp], r))
    head = [
        "plan",
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "dp bytes",
        "tp bytes",
        "pp bytes",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
