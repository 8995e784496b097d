"""Exact memory of meta-device construction, counted per rank (in-memory ranks are threads; a
``TorchDispatchMode`` is per thread) from every tensor an operation creates, as live bytes of storage
over time (a storage's bytes are released when torch frees it). Tensors under 64 bytes are not
counted: the initialization check's 0-dimensional scalars (4 and 1 bytes) and the strategies' one-element
placeholders of a parked parameter's shape.

- ZeRO-3 and FSDP (and the composition over them): the shards (parameters and gradients) exist from the
  start; the peak during construction is what is held afterwards plus the largest single module whole
  (plus its tensor-parallel slice, which ZeRO-3/FSDP fill before they keep their shard of it).
- Tensor and pipeline parallelism over DDP-like data parallelism: what this rank keeps grows module by
  module; the peak is the larger of what is held afterwards (parameters and the strategy's gradient
  buffers) and, over the walk, the part kept so far plus one module whole (plus its slice).

The parameter bytes held afterwards equal a plainly built and wrapped model's (``memory_report()``).
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from live_bytes import LiveBytes
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.core.placement import Shard, placement_of
from dtlab.models import (
    FSDPModel,
    HybridShardedModel,
    ModuleClassPolicy,
    PipelineParallelModel,
    TensorParallelModel,
    ZeRO3Model,
    transformer_plan,
)
from dtlab.testing import run_world
from dtlab.zoo.builtin import Block, TransformerLM


def _lm() -> TransformerLM:
    return TransformerLM(d_model=32, n_layers=6, n_heads=8, seq_len=8)


def _build(case: str, net: nn.Module, backend: CommunicationBackend, **kw: Any) -> Any:
    p = backend.world_size
    blocks = ModuleClassPolicy((Block,))
    if case == "zero3":
        return ZeRO3Model(net, backend, persistence_threshold=0, **kw)
    if case == "fsdp":
        return FSDPModel(net, backend, wrap_policy=blocks, **kw)
    if case == "tp":
        return TensorParallelModel(net, backend, plan=transformer_plan(), **kw)
    if case == "pp":
        return PipelineParallelModel(net, backend, **kw)
    if case == "tp-fsdp":
        mesh = Mesh(backend, {"tp": p})
        return HybridShardedModel(net, mesh, "fsdp", tensor_plan=transformer_plan(), wrap_policy=blocks, **kw)
    mesh = Mesh(backend, {"pp": 2, "dp": 2, "tp": p // 4})  # dp2 x tp x pp2, FSDP over dp
    return HybridShardedModel(
        net, mesh, "fsdp", tensor_plan=transformer_plan(), micro_batches=2, wrap_policy=blocks, **kw
    )


SHARDS_FIRST = {"zero3", "fsdp", "tp-fsdp", "dp2xtpxpp2"}


def _modules(whole: nn.Module, model: Any) -> list[tuple[int, int, bool]]:
    """For each module of the whole model (``whole``, on the meta device) with tensors of its own, in
    registration order: its bytes whole, the bytes this rank keeps of it (its tp slice; 0 for another
    rank's stage), whether sliced."""
    held = {n: q for n, q in model.module.named_parameters()}
    out = []
    for mname, mod in whole.named_modules():
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        names = [f"{mname}.{n}" if mname else n for n, _ in own]
        size = sum(q.numel() * q.element_size() for _, q in own)
        kept = sum(held[n].numel() * held[n].element_size() for n in names if n in held)
        sliced = any(isinstance(placement_of(held[n]), Shard) for n in names if n in held)
        out.append((size, kept, sliced))
    return out


def _expected_peak(case: str, after: int, modules: list[tuple[int, int, bool]]) -> int:
    if case in SHARDS_FIRST:
        return after + max(size + (kept if sliced else 0) for size, kept, sliced in modules)
    peak, prefix = after, 0
    for size, kept, sliced in modules:
        peak = max(peak, prefix + size + (kept if sliced else 0))
        prefix += kept
    return peak


CASES = ["zero3", "fsdp", "tp", "pp", "tp-fsdp", "dp2xtpxpp2"]


def _measure(backend: CommunicationBackend) -> dict[str, dict[str, Any]]:
    # one meta build per rank, copied for each case: a copy of a meta model is the same meta model
    # (building one on the meta device runs torch's Python decompositions of every initializer: slow)
    with torch.device("meta"):
        whole = _lm()
    out = {}
    for case in CASES:
        if case == "dp2xtpxpp2" and backend.world_size < 4:
            continue  # dp2 x tp x pp2 needs 4 ranks or more
        net = copy.deepcopy(whole)
        tracker = LiveBytes()
        with tracker:
            model = _build(case, net, backend, init_seed=3)
        gc.collect()
        with seeded_init(3):
            plain_net = _lm()
        plain = _build(case, plain_net, backend)
        out[case] = {
            "peak": tracker.peak,
            "after": tracker.now,
            "expected": _expected_peak(case, tracker.now, _modules(whole, model)),
            "params": (model.memory_report()["parameters"], plain.memory_report()["parameters"]),
        }
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_construction_peak_is_the_share_plus_one_module(world: int) -> None:
    """ZeRO-3, FSDP per block, TP, PP, TP over FSDP and dp2 x tp x pp2 (FSDP), each rank of P."""
    # the objects alive before the test are never garbage the measurement needs collected: frozen,
    # they make each rank's full gc.collect() cheap (it walks only the objects made since)
    gc.freeze()
    try:
        results = run_world(world, _measure)
    finally:
        gc.unfreeze()
    for rank, res in enumerate(results):
        assert len(res) == len(CASES) - (world < 4)
        for case, got in res.items():
            where = f"{case} rank {rank}/{world}"
            assert got["params"][0] == got["params"][1], where
            assert got["peak"] == got["expected"], (where, got)
