"""``dtlab advise``'s predictions next to dtlab's own runs; print a markdown table.

    .venv/bin/python -m dtlab.benchmarks.advise_accuracy            # the embedded transformer, tiny sizes

For every plan of the grid it runs two steps of the embedded transformer (AdamW, 2 blocks, width 32,
16 tokens, global batch 8) on in-memory ranks through ``model.train_step`` (as ``dtlab train`` steps)
and prints, per plan, the predicted and the measured bytes of rank 0: parameters and gradients from
``memory_report()``, the optimizer state the largest over the ranks (advise predicts the rank that
holds the most), activations as the bytes autograd saved during the second step's forward
(``saved_tensors_hooks``, distinct storages, parameters and the batch left out; not measured under
ZeRO-3/FSDP), and the bytes sent per mesh axis during the second step, from ``backend.stats``. A
difference is shown in bytes. The data-parallel strategies are built as ``dtlab train`` builds them;
tensor parallelism with ``TensorParallelModel(module, mesh, plan=transformer_plan())``; pipelines with
``PipelineParallelModel(module, mesh, schedule, micro_batches=m)`` (one row per pipeline rank; their
activations are the model's own ``memory_report()["activations"]``). docs/strategies.md ("How exact it
is") prints the table; tests/test_advise_doc_table.py checks its predicted figures against advise.
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
PIPELINES: list[tuple[ModelSpec, Candidate]] = [
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
                model.train_step((x, y), loss_fn)  # as dtlab train steps (one tp batch check a step)
            acts = saved.total
        else:
            model.train_step((x, y), loss_fn)
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
    """Bytes are exact counts: a difference is shown in bytes (a percentage would round it to 0.0%)."""
    if got is None:
        return f"{pred:,} / -"
    if pred == got:
        return f"{pred:,} / {got:,}"
    return f"{pred:,} / {got:,} ({pred - got:+,} B)"


AXES = ("dp", "tp", "pp")
HEAD = ["plan", "parameters", "gradients", "optimizer state", "activations", *(f"{a} bytes" for a in AXES)]


def grid() -> list[tuple[ModelSpec, Candidate]]:
    """The plans of the table, in its order: every data-parallel strategy at dp 2 and 4, DDP and ZeRO-1
    at tp 2, tp 4 and dp2 x tp2, then the pipelines."""
    plans: list[tuple[ModelSpec, Candidate]] = [
        (SPEC, Candidate(strategy, dp=world))  # type: ignore[arg-type]
        for world in (2, 4)
        for strategy in pairs.DATA_PARALLEL
    ]
    for shape in ({"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}):
        for strategy in ("ddp", "zero1"):
            plans.append((TP_SPEC, Candidate(strategy, dp=shape.get("dp", 1), tp=shape["tp"])))
    return plans + PIPELINES


def predicted(spec: ModelSpec, plan: Candidate, r: int = 0) -> tuple[str, list[int | None]]:
    """A row's label and advise's figures for pipeline rank ``r``: parameters, gradients, optimizer
    state, activations, then the bytes sent per axis in a step (None for an axis the plan lacks)."""
    p = predict(spec, ClusterSpec(ranks=plan.ranks), plan, BATCH)
    want, ops = p.stage_memory[r], p.stage_ops[r]
    sent = [
        sum(b for k, (_, b) in ops[a].items() if k != "recv") if a == "dp" or getattr(plan, a) > 1 else None
        for a in AXES
    ]
    label = plan.label + (f" (pp rank {r})" if plan.pp > 1 else "")
    return label, [want.parameters, want.gradients, want.optimizer_state, want.activations, *sent]


def _measured(ranks: list[dict[str, Any]]) -> list[int | None]:
    """``ranks``: the results of one pipeline stage's ranks, the first one's shown; the optimizer state
    is the largest of them, as advise predicts it (a sharded optimizer keeps one piece per parameter its
    shard overlaps, so the ranks' states differ by a few bytes)."""
    got = ranks[0]
    mem = got["memory"]
    state = max(g["memory"]["optimizer_state"] for g in ranks)
    sent = [got["bytes"].get(a) for a in AXES]
    return [mem["parameters"], mem["gradients"], state, got["activations"], *sent]


def _run(spec: ModelSpec, plan: Candidate) -> list[dict[str, Any]]:
    if plan.pp > 1:
        return run_world(plan.ranks, _pipeline, spec, plan)
    if plan.tp > 1:
        shape = {"dp": plan.dp, "tp": plan.tp} if plan.dp > 1 else {"tp": plan.tp}
        return run_world(plan.ranks, _tensor_parallel, shape, plan.strategy)
    overrides = [*TINY_LM, *SIZES, f"strategy.model={plan.strategy}", f"backend.world_size={plan.dp}"]
    config = load_config(overrides=overrides)
    return run_world(plan.dp, _data_parallel, config, build_task(config))


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for spec, plan in grid():
        results = _run(spec, plan)
        for r in range(plan.pp):
            label, want = predicted(spec, plan, r)
            got = _measured(results[r * plan.dp : (r + 1) * plan.dp])
            cells = ["-" if w is None else _cell(w, g) for w, g in zip(want, got, strict=True)]
            print("| " + " | ".join([label, *cells]) + " |")


if __name__ == "__main__":
    main()
