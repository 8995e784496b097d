"""The hybrid strategy's exact counts and checks on 2 x 2 x 2 in-memory ranks: memory per rank per axis
(a stage's parameters only, split layers 1/tp, optimizer state and gradients 1/dp where the strategy
shards them), bytes over the pp and dp axes, clipping and the finite check across the whole mesh
against one process, compression on the dp axis (Dense = the plain run), and the refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model, train_hybrid
from refusals import refusal_messages
from test_tensor_helpers import (
    BATCH,
    CFG,
    SEQ,
    STEPS,
    batch,
    build,
    clip_reference,
    max_rel_error,
    train_reference,
)

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, transformer_plan
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer
from dtlab.testing import run_world

F32 = 4
CUBE = {"pp": 2, "dp": 2, "tp": 2}
SPLIT = ["blocks.1"]  # stage 0: embedding and block 0; stage 1: block 1, final norm and head
#: parameters split over tp by the built-in plan (everything else is whole on every tp rank)
TP_SPLIT = (
    "tok.weight",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.0.weight",
    "mlp.0.bias",
)
TP_SPLIT += ("mlp.2.weight", "head.weight")


def _stage_numels(stage: int, tp: int) -> list[int]:
    """Local element counts of stage ``stage``'s parameters, from the plain model and the plan's rule."""
    net = build(None, torch.float32)
    prefixes = ("tok.", "pos.", "blocks.0.") if stage == 0 else ("blocks.1.", "ln_f.", "head.")
    out = []
    for name, p in net.named_parameters():
        if name.startswith(prefixes):
            out.append(p.numel() // tp if name.endswith(TP_SPLIT) else p.numel())
    return out


def _pad(n: int, p: int) -> int:
    return -(-n // p) * p


def memory_world(backend: CommunicationBackend, data_parallel: str) -> dict[str, Any]:
    model = hybrid_model(backend, CUBE, data_parallel, split_points=SPLIT, micro_batches=2)
    opt = OPTIMIZER_OF[data_parallel](model, torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = batch()
    c = model.mesh.coordinate("dp")
    pp, dp = model.pp_group, model.dp_backend
    for g in (pp, dp):
        g.stats.reset()
    model.train_step((x.chunk(2)[c], y.chunk(2)[c]), model.cross_entropy)
    opt.step()
    opt.zero_grad()
    return {
        "stage": model.mesh.coordinate("pp"),
        "memory": opt.memory_report(),
        "pp_sent": pp.stats["send"].bytes_sent,
        "dp": dp.stats.snapshot(),
    }


@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_memory_per_rank_is_exact_per_axis(data_parallel: str) -> None:
    dp = 2
    for rank, out in enumerate(run_world(8, memory_world, data_parallel, timeout=120)):
        sizes = _stage_numels(out["stage"], tp=2)  # the stage's parameters only, split layers 1/tp
        n = sum(sizes)
        whole, shard = _pad(n, dp) * F32, _pad(n, dp) // dp * F32
        per_param = sum(_pad(s, dp) // dp for s in sizes) * F32  # ZeRO-3: one unit per parameter
        want = {
            "ddp": (whole, whole, n * F32),
            "zero1": (whole, whole, shard),
            "zero2": (whole, shard, shard),
            "zero3": (per_param, per_param, per_param),
            "fsdp": (shard, shard, shard),
        }[data_parallel]
        mem = out["memory"]
        got = (mem["parameters"], mem["gradients"], mem["optimizer_state"])
        assert got == want, f"{data_parallel} rank {rank}: {got} != {want}"
        # between stages: each micro-batch's (b/dp/m, s, h) activation forward, its gradient back
        assert out["pp_sent"] == 2 * (BATCH // 4) * SEQ * CFG["d_model"] * F32, f"rank {rank}"
        # one bucket, all-reduced once: 2(P-1)/P of it at P = 2; first every replica's count of unused
        # parameters per pipeline rank (dp x pp float32 all-reduced: 8 pp (dp - 1) bytes)
        if data_parallel == "ddp":
            assert out["dp"]["all_reduce"]["bytes_sent"] == whole + 8 * 2 * (dp - 1), f"rank {rank}"


def clip_world(backend: CommunicationBackend, data_parallel: str, norm_type: float) -> dict[str, Any]:
    model = hybrid_model(backend, CUBE, data_parallel, sequence_parallel=True, micro_batches=2)
    opt = OPTIMIZER_OF[data_parallel](model, torch.optim.SGD, lr=0.1)
    x, y = batch()
    c = model.mesh.coordinate("dp")
    model.train_step((x.chunk(2)[c], y.chunk(2)[c]), model.cross_entropy)
    norm = float(opt.clip_grad_norm_(0.05, norm_type))
    finite = opt.grads_are_finite()
    opt.step()
    return {"norm": norm, "finite": finite, "state": model.full_state_dict()}


@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "fsdp"])
def test_clipping_over_the_whole_mesh_equals_one_process(data_parallel: str) -> None:
    for norm_type in (2.0, float("inf")):
        want, net = clip_reference(norm_type)
        for rank, out in enumerate(run_world(8, clip_world, data_parallel, norm_type, timeout=120)):
            where = f"{data_parallel} norm_type={norm_type} rank {rank}"
            assert abs(out["norm"] - want) <= 1e-5 * want, f"{where}: norm {out['norm']} != {want}"
            assert out["finite"], where
            assert max_rel_error(out["state"], net.state_dict()) <= 1e-5, where


def nonfinite_world(backend: CommunicationBackend) -> bool:
    model = hybrid_model(backend, CUBE, "zero2", micro_batches=2)
    opt = ZeRO2Optimizer(model, torch.optim.SGD, lr=0.1)
    x, y = batch()
    c = model.mesh.coordinate("dp")
    model.train_step((x.chunk(2)[c], y.chunk(2)[c]), model.cross_entropy)
    if backend.rank == 7:  # the last stage, dp rank 1, tp rank 1: its own slice of a tp shard
        unit = model.shard_units()[0]
        model.shard_grad(unit)[0] = float("nan")
    return opt.grads_are_finite()


def test_the_finite_check_spans_the_mesh() -> None:
    assert run_world(8, nonfinite_world, timeout=120) == [False] * 8


def test_dense_compression_on_the_dp_axis_equals_the_plain_run() -> None:
    from dtlab.compression import Dense
    from dtlab.optimizers import GradientCompressionOptimizer

    def dense(opt: Any) -> GradientCompressionOptimizer:
        return GradientCompressionOptimizer(opt, Dense())

    ref_losses, ref_state = train_reference("sgd")
    for data_parallel in ("ddp", "zero2"):
        results = run_world(
            8, train_hybrid, CUBE, data_parallel, "sgd", True, dense, micro_batches=2, timeout=120
        )
        for rank, (losses, state) in enumerate(results):
            assert losses == pytest.approx(ref_losses, rel=1e-5), f"{data_parallel} rank {rank}"
            assert max_rel_error(state, ref_state) <= 1e-5, f"{data_parallel} rank {rank}"


def refusals_world(backend: CommunicationBackend) -> list[str]:
    mesh = Mesh(backend, {"pp": 2, "tp": 2})
    attempts = [
        lambda: HybridShardedModel(build(None, torch.float32), mesh, data_parallel="zero9"),
        lambda: HybridShardedModel(build(None, torch.float32), mesh, data_parallel="ddp"),  # no plan
        lambda: HybridShardedModel(
            build(None, torch.float32), mesh, "fsdp", transformer_plan(), split_points=["blocks.9"]
        ),
        lambda: DDPOptimizer(
            HybridShardedModel(build(None, torch.float32), mesh, "zero2", transformer_plan()),
            torch.optim.SGD,
            lr=0.1,
        ),
    ]
    return refusal_messages(attempts)


def test_refusals_name_the_fix() -> None:
    errors = run_world(4, refusals_world, timeout=60)[0]
    needles = [
        "data_parallel='zero9'): choose one of ddp, zero1, zero2, zero3, fsdp",
        "tp=2 needs a tensor_plan",
        "split points ['blocks.9'] name no pipeline block",
        "is driven by ZeRO2Optimizer, got DDPOptimizer",
    ]
    assert len(errors) == len(needles), errors
    for needle, error in zip(needles, errors, strict=True):
        assert needle in error, (needle, error)


def test_a_wrong_optimizer_on_one_rank_fails_the_world() -> None:
    def world(backend: CommunicationBackend) -> None:
        model = hybrid_model(backend, {"dp": 2, "tp": 2}, "fsdp")
        DDPOptimizer(model, torch.optim.SGD, lr=0.1)

    with pytest.raises(RankFailedError, match=r"ZeRO3Optimizer"):
        run_world(4, world, timeout=60)


assert STEPS == 5  # the parity tests' step count (test_tensor_helpers)


def oktopk_world(backend: CommunicationBackend, compressor: str, shape: dict[str, int]) -> dict[str, Any]:
    from dtlab.compression import Dense, OkTopk
    from dtlab.optimizers import GradientCompressionOptimizer

    model = hybrid_model(backend, shape, "ddp", split_points=SPLIT, micro_batches=2)
    inner = OPTIMIZER_OF["ddp"](model, torch.optim.SGD, lr=0.1, momentum=0.9)
    comp = Dense() if compressor == "dense" else OkTopk(density=0.05, warmup_steps=0)
    opt = GradientCompressionOptimizer(inner, comp)
    x, y = batch()
    c = model.mesh.coordinate("dp")
    groups = {"dp": model.dp_backend, "tp": model.tp_group, "pp": model.pp_group}
    losses, sent = [], {a: 0 for a in groups}
    for _ in range(4):
        for g in groups.values():
            g.stats.reset()
        try:
            losses.append(float(model.train_step((x.chunk(2)[c], y.chunk(2)[c]), model.cross_entropy)))
        except StrategyError as exc:
            return {"refused": str(exc)}
        opt.step()
        opt.zero_grad()
        for a, g in groups.items():
            sent[a] += sum(s["bytes_sent"] for s in g.stats.snapshot().values())
    return {"losses": losses, "sent": sent, "density": opt.statistics.get("density")}


def test_oktopk_compresses_the_dp_axis_only() -> None:
    """Ok-Topk on the dp axis of pp 2 x dp 2 trains (same batch, 4 steps: the loss falls) and sends
    fewer dp bytes than Dense through the same wrapper; pp traffic is unchanged. With tp = 2 as well
    (the 2 x 2 x 2 cube) it trains too: each bucket's parameters every tp rank holds whole are compressed
    apart from its tp shards, so every tp rank keeps the same elements of them (tests/test_compression_tp.py
    checks their copies bitwise equal)."""
    shape = {"pp": 2, "dp": 2}
    dense = run_world(4, oktopk_world, "dense", shape, timeout=120)
    sparse = run_world(4, oktopk_world, "oktopk", shape, timeout=120)
    for rank, (d, s) in enumerate(zip(dense, sparse, strict=True)):
        assert all(math.isfinite(v) for v in s["losses"]), (rank, s["losses"])
        assert s["losses"][-1] < s["losses"][0], (rank, s["losses"])
        assert s["sent"]["dp"] < d["sent"]["dp"] / 2, (rank, s["sent"], d["sent"])
        assert s["sent"]["tp"] == d["sent"]["tp"] == 0 and s["sent"]["pp"] == d["sent"]["pp"], rank
        assert s["density"] is not None and 0 < s["density"] < 0.2, (rank, s["density"])
    for rank, res in enumerate(run_world(8, oktopk_world, "oktopk", CUBE, timeout=120)):
        assert "refused" not in res, (rank, res.get("refused"))
        assert res["losses"][-1] < res["losses"][0], (rank, res["losses"])
        assert res["density"] is not None and 0 < res["density"] < 0.2, (rank, res["density"])
