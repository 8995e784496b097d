"""``dtlab advise``'s predictions next to dtlab's own runs; print a markdown table.

    .venv/bin/python benchmarks/advise_accuracy.py            # the embedded transformer, tiny sizes

For every plan of the grid it runs two steps of the embedded transformer (AdamW) on in-memory ranks
with the strategies ``dtlab train`` builds, and prints, per plan, the predicted and the measured bytes
of rank 0: parameters, gradients and optimizer state from ``memory_report()``, activations as the
bytes autograd saved during the second step's forward (``saved_tensors_hooks``, distinct storages,
parameters left out; not measurable under ZeRO-3/FSDP, whose own hooks replace the saved tensors),
and the bytes sent per mesh axis during the second step from ``backend.stats``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, predict
from dtlab.config import load_config
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers.build import build_model_strategy, build_optimizer_strategy
from dtlab.trainers.tasks import build_task, cross_entropy_loss

SIZES = ["model.n_layers=2", "model.seq_len=16", "data.global_batch_size=8", "optimizer.name=adamw"]


class SavedBytes:
    """Bytes autograd keeps for the backward: distinct storages, the parameters' left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
        self._seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() and t.untyped_storage().data_ptr() not in self._params:
            self._seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def _data_parallel(backend: Any, config: Any, task: Any) -> dict[str, Any]:
    model, _ = build_model_strategy(config, backend, task)
    opt = build_optimizer_strategy(config, model)
    g = torch.Generator().manual_seed(100 + backend.rank)
    local = config.data.global_batch_size // backend.world_size
    hooks = config.strategy.model in ("ddp", "zero1", "zero2")
    acts = None
    for step in range(2):
        x = torch.randint(0, 256, (local, config.model.seq_len), generator=g)
        y = torch.randint(0, 256, (local, config.model.seq_len), generator=g)
        if step == 1:
            backend.stats.reset()
        if step == 1 and hooks:
            saved = SavedBytes(model)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = cross_entropy_loss(model(x), y)
            acts = saved.total
        else:
            loss = cross_entropy_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"memory": opt.memory_report(), "dp": backend.stats.bytes_sent, "activations": acts}


def _cell(pred: int, got: int | None) -> str:
    if got is None:
        return f"{pred:,} / -"
    err = 0.0 if pred == got else (pred - got) / got * 100 if got else float("inf")
    return f"{pred:,} / {got:,} ({err:+.1f}%)"


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    rows = []
    for world in (2, 4):
        for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            config = load_config(
                overrides=[*TINY_LM, *SIZES, f"strategy.model={strategy}", f"backend.world_size={world}"]
            )
            m = config.model
            spec = ModelSpec.builtin(
                d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, seq_len=m.seq_len
            )
            got = run_world(world, _data_parallel, config, build_task(config))[0]
            plan = Candidate(strategy, dp=world)  # type: ignore[arg-type]
            p = predict(spec, ClusterSpec(ranks=world), plan, config.data.global_batch_size)
            mem = got["memory"]
            rows.append(
                [
                    plan.label,
                    _cell(p.memory.parameters, mem["parameters"]),
                    _cell(p.memory.gradients, mem["gradients"]),
                    _cell(p.memory.optimizer_state, mem["optimizer_state"]),
                    _cell(p.memory.activations, got["activations"]),
                    _cell(p.axes["dp"].bytes_sent, got["dp"]),
                ]
            )
    head = ["plan", "parameters", "gradients", "optimizer state", "activations", "dp bytes/step"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
