"""What each rank runs for one configuration of the mesh benchmark (``dtlab.benchmarks.mesh``): the
model and optimizer strategies as ``dtlab train`` builds them, timed steps on random tokens, the bytes
each rank sends per axis, its memory report and the activations autograd keeps."""

from __future__ import annotations

import time
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.config import TrainConfig
from dtlab.data import TensorDataset
from dtlab.models import ModelStrategy
from dtlab.trainers.build import build_model_strategy, build_optimizer_strategy
from dtlab.trainers.parallel import parallel_loss
from dtlab.trainers.tasks import Task, cross_entropy_loss
from dtlab.zoo import Block, TransformerLM

__all__ = ["AXES", "measure", "world_runs"]

AXES = ("dp", "tp", "pp")


def _task(config: TrainConfig) -> Task:
    m = config.model
    tokens = torch.zeros(4, m.seq_len, dtype=torch.long)
    data = TensorDataset(tokens, tokens)
    return Task(
        build_model=lambda: TransformerLM(m.d_model, m.n_layers, m.n_heads, m.seq_len),
        train_data=data,
        eval_data=data,
        fsdp_unit_classes=(Block,),
    )


def _groups(model: ModelStrategy) -> dict[str, CommunicationBackend]:
    mesh = getattr(model, "mesh", None)  # the strategies built over a mesh show it
    if not isinstance(mesh, MeshLike):
        return {"dp": model.dp_backend}
    return {a: mesh[a] for a in AXES}


def measure(backend: CommunicationBackend, config: TrainConfig, steps: int, warmup: int) -> dict[str, Any]:
    """One configuration on this rank: step times, bytes per axis per step, the memory report."""
    model, _ = build_model_strategy(config, backend, _task(config))
    opt = build_optimizer_strategy(config, model)
    loss_fn = parallel_loss(model, cross_entropy_loss, cross_entropy_loss, config.parallel.tp)
    groups = _groups(model)
    dp = model.dp_backend
    g = torch.Generator().manual_seed(1 + dp.rank)
    local = config.data.global_batch_size // dp.world_size
    seq = config.model.seq_len
    times = []
    acts: int | None = None
    for i in range(warmup + steps):
        x = torch.randint(0, 256, (local, seq), generator=g)
        y = torch.randint(0, 256, (local, seq), generator=g)
        if i == warmup:
            for group in groups.values():
                group.stats.reset()
        backend.barrier()
        t0 = time.perf_counter()
        model.train_step((x, y), loss_fn)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    memory = opt.memory_report()
    sent = {a: g.stats.bytes_sent // steps for a, g in groups.items()}
    if "activations" in memory:  # a pipeline counts them itself
        acts = memory["activations"]
    elif config.strategy.model not in ("zero3", "fsdp"):  # not measured there
        saved = _SavedBytes([*model.parameters(), x, y])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            model.train_step((x, y), loss_fn)
        opt.zero_grad()
        acts = saved.total
    return {"times": times[warmup:], "sent": sent, "memory": memory, "activations": acts}


class _SavedBytes:
    """Bytes autograd keeps for the backward: distinct storages, parameters and the batch left out
    (as the pipeline's meter counts them)."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in excluded if t.numel()}
        self._seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.numel() and st.data_ptr() not in self._excluded:
            self._seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def world_runs(
    backend: CommunicationBackend, configs: list[TrainConfig], steps: int, warmup: int, rounds: int
) -> list[list[Any]]:
    """Every configuration in one world (spawned engines), ``rounds`` times interleaved: per round, one
    result per configuration."""
    return [[measure(backend, c, steps, warmup) for c in configs] for _ in range(rounds)]
