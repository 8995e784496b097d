"""Shared pieces of the hybrid (3-D) tests: one rank's training on a mesh and the single-process
reference (module-level, so spawned gloo/MPI worlds can import them). The model, the batch and the
optimizers are those of the tensor-parallel tests (``test_tensor_helpers``): AdamW runs in float64
(see there why), SGD with momentum in float32."""

from __future__ import annotations

from typing import Any

import torch
from test_tensor_helpers import OPTIMIZERS, STEPS, batch, build, initial_state

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel, ModuleClassPolicy, transformer_plan
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.trainers.models import Block

OPTIMIZER_OF: dict[str, type[Any]] = {
    "ddp": DDPOptimizer,
    "zero1": ZeRO1Optimizer,
    "zero2": ZeRO2Optimizer,
    "zero3": ZeRO3Optimizer,
    "fsdp": ZeRO3Optimizer,
}


def hybrid_model(
    backend: CommunicationBackend | Mesh,
    shape: dict[str, int],
    data_parallel: str,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    **pipeline: Any,
) -> HybridShardedModel:
    """The tiny transformer on a mesh. Only each stage's rank 0 of dp x tp starts from the reference
    state (the others start random), so the broadcasts over dp and tp are tested."""
    mesh = backend if isinstance(backend, Mesh) else Mesh(backend, shape)
    first = mesh.coordinate("dp") == 0 and mesh.coordinate("tp") == 0
    net = build(initial_state() if first else None, dtype)
    extra: dict[str, Any] = {}
    if data_parallel == "zero3":
        extra["persistence_threshold"] = 0
    if data_parallel == "fsdp":
        extra["wrap_policy"] = ModuleClassPolicy((Block,))
    plan = transformer_plan(sequence_parallel=sequence_parallel) if mesh.size("tp") > 1 else None
    return HybridShardedModel(net, mesh, data_parallel=data_parallel, tensor_plan=plan, **pipeline, **extra)


def train_hybrid(
    backend: CommunicationBackend | Mesh,
    shape: dict[str, int],
    data_parallel: str,
    opt: str,
    sequence_parallel: bool = False,
    wrap: Any = None,
    **pipeline: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` steps on this rank's dp share through ``model.train_step`` (``wrap``: e.g. a
    compression wrapper around the optimizer strategy); the dp-averaged losses and the full state."""
    cls, kwargs, dtype = OPTIMIZERS[opt]
    model = hybrid_model(backend, shape, data_parallel, dtype, sequence_parallel, **pipeline)
    optimizer: OptimizerStrategy = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
    if wrap is not None:
        optimizer = wrap(optimizer)
    x, y = batch()
    dp, coord = model.mesh.size("dp"), model.mesh.coordinate("dp")
    x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
    losses = []
    for _ in range(STEPS):
        loss = model.train_step((x, y), model.cross_entropy)
        mean = loss.detach().double().reshape(1).clone()
        model.dp_backend.all_reduce(mean)
        losses.append(mean.item() / dp)
        optimizer.step()
        optimizer.zero_grad()
    return losses, model.full_state_dict()


def train_torch_2d(backend: CommunicationBackend) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch's own 2-D composite on dp2 x tp2 (FSDP2 per block and root over DTensor TP split as
    ``transformer_plan()``, the loss under ``loss_parallel()``; ``hybrid_vs_torch.torch_2d``), AdamW
    as the reference: the dp-averaged losses and the full state (qkv rows in the model's order)."""
    from dtlab.benchmarks.hybrid_vs_torch import global_loss, torch_2d
    from dtlab.benchmarks.tensor import loss_parallel_backward, parallelize_transformer, qkv_order

    cls, kwargs, dtype = OPTIMIZERS["adamw"]
    net = torch_2d(build(initial_state(), dtype), 2, 2, Block, parallelize_transformer)
    optimizer = cls(net.parameters(), **kwargs)
    x, y = (t.chunk(2)[backend.rank // 2] for t in batch())
    forward_backward = loss_parallel_backward(net, x, y)
    losses = []
    for _ in range(STEPS):
        losses.append(global_loss(backend, forward_backward()))
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()}
    back = torch.argsort(qkv_order(net.tok.embedding_dim, 2))
    for k in state:
        if ".attn.qkv." in k:
            state[k] = state[k][back]
    return losses, state


def engine_world(backend: CommunicationBackend) -> dict[str, Any]:
    """Everything the gloo/MPI test checks, in one 4-process world: tp2 x pp2 (DDP, SGD-momentum,
    sequence parallel, 1F1B) and dp2 x tp2 (ZeRO-2, AdamW, no pipeline); on Gloo also dp2 x tp2 FSDP
    and torch's 2-D composite (FSDP2 over DTensor TP) on the same batch."""
    from dtlab.backends import GlooBackend

    runs = {
        "sgd/tp2xpp2/ddp": train_hybrid(
            backend, {"pp": 2, "tp": 2}, "ddp", "sgd", sequence_parallel=True, micro_batches=2
        ),
        "adamw/dp2xtp2/zero2": train_hybrid(backend, {"dp": 2, "tp": 2}, "zero2", "adamw"),
    }
    if isinstance(backend, GlooBackend):
        runs["adamw/dp2xtp2/fsdp"] = train_hybrid(backend, {"dp": 2, "tp": 2}, "fsdp", "adamw")
        runs["adamw/dp2xtp2/torch_2d"] = train_torch_2d(backend)
    return runs
