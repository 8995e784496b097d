"""Resuming under gradient compression continues exactly, for every compressor, during and after
warm-up: residuals, iteration counters and each compressor's own state (Ok-Topk thresholds and region
boundaries, PowerSGD factors, ...) travel in the checkpoint (safetensors + JSON). At another world
size or model strategy the compression state starts afresh with a warning."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.compression import (
    ALGORITHMS,
    BF16,
    COMPRESSORS,
    FP16,
    QSGD,
    Compressor,
    OkTopk,
    PowerSGD,
    RandomK,
    TopkA,
)
from dtlab.compression.sparse import Magnitudes
from dtlab.compression.state_io import Workspace, decode_state, encode_state
from dtlab.config import CompressionConfig, TrainConfig, load_config
from dtlab.errors import CheckpointError
from dtlab.models import DDPModel, ZeRO2Model
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import run_training

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "optimizer.warmup_steps=2",
    "train.eval_every=0",
    "strategy.persistence_threshold=0",
    "logging.progress=false",
    "compression.density=0.05",
]
STEPS, HALF = 8, 4

# (algorithm, strategy, warm-up steps): the checkpoint at step 4 falls after warm-up except for topkdsa
# (6 warm-up steps: the resumed run must do exactly 2 more dense steps). Ok-Topk: compressed iterations
# t = 0, 1, 2 before the checkpoint; t = 3 reuses the thresholds (tau=4) and boundaries (tau'=5).
CASES = [
    ("dense", "ddp", 0),
    ("topka", "ddp", 1),
    ("topkdsa", "ddp", 6),
    ("gtopk", "ddp", 2),
    ("gaussiank", "ddp", 1),
    ("oktopk", "ddp", 1),
    ("oktopk", "zero2", 1),
    # the compressors, chosen from the config too (PowerSGD's Q factors, random-k's and QSGD's counters)
    ("randomk", "ddp", 1),
    ("qsgd", "zero2", 0),
    ("powersgd", "ddp", 2),
    ("fp16", "fsdp", 0),
    ("bf16", "ddp", 0),
]


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    return load_config(overrides=[*TINY, f"logging.run_dir={tmp / 'run'}", *extra])


def test_cases_cover_every_algorithm() -> None:
    assert {c[0] for c in CASES} >= set(ALGORITHMS)
    allowed = set(get_args(CompressionConfig.model_fields["algorithm"].annotation))
    assert {c[0] for c in CASES} == allowed - {"none"}  # every compressor the config can name
    assert allowed - {"none"} == set(COMPRESSORS)  # the config names exactly the registry's compressors


@pytest.mark.parametrize(("algorithm", "strategy", "warmup"), CASES)
def test_trainer_resume_is_exact_for_every_algorithm(
    tmp_path: Path, algorithm: str, strategy: str, warmup: int
) -> None:
    common = [
        f"strategy.model={strategy}",
        f"train.steps={STEPS}",
        f"compression.algorithm={algorithm}",
        f"compression.dense_warmup_steps={warmup}",
        "compression.tau=4",
        "compression.tau_prime=5",
    ]
    ck = tmp_path / "ck"
    full = run_training(_cfg(tmp_path, *common, f"checkpoint.dir={ck}", f"checkpoint.every={HALF}"))
    resume = f"checkpoint.resume={ck / f'step_{HALF:08d}'}"
    resumed = run_training(_cfg(tmp_path, *common, f"checkpoint.dir={tmp_path / 'again'}", resume))
    assert resumed[0].start_step == HALF
    assert [s for s, _ in resumed[0].losses] == list(range(HALF + 1, STEPS + 1))
    assert resumed[0].losses == full[0].losses[HALF:], algorithm  # bitwise the same sequence
    saved = read_checkpoint(ck / f"step_{HALF:08d}")
    assert saved.optim is not None
    comp = saved.optim[0].metadata["compression"]
    buffers = comp["buffers"]
    if algorithm == "dense":  # nothing compressed, nothing to carry
        assert buffers == {}
        return
    assert buffers and all(b["iterations"] == HALF for b in buffers.values())
    if algorithm == "oktopk" and strategy == "ddp":
        state = next(iter(buffers.values()))["state"]
        assert state["t"] == HALF - warmup and state["global_thr"] > 0 and "work" not in state
        assert (HALF - warmup) % 4 and (HALF - warmup) % 5  # the resume falls between re-evaluations


# ---------------------------------------------------------------- every other compressor, directly
def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3))
    return filled(net, 0, scale=0.3)


def _build(
    backend: CommunicationBackend, compressor: Compressor, zero2: bool
) -> GradientCompressionOptimizer:
    if zero2:
        inner: Any = ZeRO2Optimizer(ZeRO2Model(_net(), backend), torch.optim.SGD, lr=0.2, momentum=0.9)
    else:
        model = DDPModel(_net(), backend, bucket_cap_mb=0.004)
        inner = DDPOptimizer(model, torch.optim.SGD, lr=0.2, momentum=0.9)
    return GradientCompressionOptimizer(inner, compressor, dense_below=64)


def _step(opt: GradientCompressionOptimizer, backend: CommunicationBackend, s: int) -> float:
    g = torch.Generator().manual_seed(1000 + s)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 3, (32,), generator=g)
    per = 32 // backend.world_size
    sl = slice(backend.rank * per, (backend.rank + 1) * per)
    opt.zero_grad()
    loss = opt.model.train_step((x[sl], y[sl]), nn.functional.cross_entropy)
    opt.step()
    return float(loss)


def _direct(backend: CommunicationBackend, compressor: Compressor, zero2: bool, root: Path) -> dict[str, Any]:
    steps, half = 8, 4
    a = _build(backend, compressor, zero2)
    losses = []
    for s in range(steps):
        losses.append(_step(a, backend, s))
        if s + 1 == half:  # through real checkpoint files: safetensors + JSON
            save_checkpoint(
                root, half, backend, a.model.sharded_state_dict(), a.sharded_state_dict(), {}, {"step": half}
            )
    ckpt = read_checkpoint(root)
    b = _build(backend, compressor, zero2)
    b.model.load_sharded_state_dict(ckpt.model)
    assert ckpt.optim is not None
    b.load_sharded_state_dict(ckpt.optim)
    resumed = [_step(b, backend, s) for s in range(half, steps)]
    return {"full": losses[half:], "resumed": resumed, "stats": a.statistics}


DIRECT = [
    ("randomk", RandomK(density=0.05, warmup_steps=1), False),
    ("qsgd", QSGD(warmup_steps=1), False),
    ("powersgd_after_warmup", PowerSGD(rank=2, warmup_steps=2), False),
    ("powersgd_during_warmup", PowerSGD(rank=2, warmup_steps=6), False),
    ("fp16", FP16(), False),
    ("bf16", BF16(), False),
    ("oktopk_zero2", OkTopk(density=0.05, tau=3, tau_prime=3, warmup_steps=0), True),
]


@pytest.mark.parametrize(("name", "compressor", "zero2"), DIRECT, ids=[d[0] for d in DIRECT])
def test_direct_resume_is_exact_for_every_compressor(
    tmp_path: Path, name: str, compressor: Compressor, zero2: bool
) -> None:
    for r in run_world(2, _direct, compressor, zero2, tmp_path / "ck"):
        assert r["resumed"] == r["full"], name  # bitwise
        assert all(math.isfinite(v) for v in r["full"])
        assert r["stats"]["dense_calls"] < r["stats"]["calls"], r["stats"]  # the last step compressed


# ---------------------------------------------------------------- another world size or strategy
def test_other_world_size_reshards_and_other_strategy_starts_compression_afresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    common = ["compression.algorithm=oktopk", "compression.dense_warmup_steps=1", "train.steps=6"]
    ck = tmp_path / "ck"
    run_training(_cfg(tmp_path, *common, f"checkpoint.dir={ck}", "checkpoint.every=3"))
    resume = f"checkpoint.resume={ck / 'step_00000003'}"
    for extra, what, why in (
        ("backend.world_size=2", "compression state resharded", "written by 4 ranks, this run has 2"),
        (
            "strategy.model=zero2",
            "compression state not restored",
            "model strategy 'ddp', this run uses 'zero2'",
        ),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dtlab"):
            out = run_training(_cfg(tmp_path, *common, extra, resume))
        assert [s for s, _ in out[0].losses] == [4, 5, 6]
        assert all(math.isfinite(v) for _, v in out[0].losses)
        warned = [r.getMessage() for r in caplog.records if "compression state" in r.getMessage()]
        assert len(warned) == 1 and what in warned[0] and why in warned[0], warned


def _reload(backend: CommunicationBackend, other: Compressor) -> dict[str, Any]:
    a = _build(backend, OkTopk(density=0.05, warmup_steps=1), False)
    for s in range(3):
        _step(a, backend, s)
    shards = backend.all_gather_object(a.sharded_state_dict())
    b = _build(backend, other, False)
    b.load_sharded_state_dict(shards)
    keys = a.reducer.error_feedback.keys()
    return {
        "keys": keys,
        "residuals": all(
            torch.equal(a.reducer.error_feedback.residual(k), b.reducer.error_feedback.residual(k))
            for k in keys
        ),  # type: ignore[arg-type]
        "iterations": [b.reducer.iteration(k) for k in keys],
        "saved": b.reducer.state_dict()[1]["buffers"],
    }


def test_other_compressor_keeps_residuals_and_counters_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dtlab"):
        results = run_world(2, _reload, TopkA(density=0.1, warmup_steps=1))
    for r in results:
        assert r["keys"] and r["residuals"] and r["iterations"] == [3] * len(r["keys"])
        assert all(b["state"] == {} for b in r["saved"].values())  # Ok-Topk's thresholds were dropped
    assert sum("compressor state not restored" in r.getMessage() for r in caplog.records) == 1


def _torch_layout_reload(backend: CommunicationBackend) -> bool:
    a = _build(backend, TopkA(density=0.1, warmup_steps=1), False)
    for s in range(3):
        _step(a, backend, s)
    saved = a.state_dict()  # torch's layout: no residuals, counters or compressor state
    a.load_state_dict(saved)  # mid-run round trip: a keeps its own compression state, no warning
    b = _build(backend, TopkA(density=0.1, warmup_steps=1), False)
    b.load_state_dict(saved)  # a fresh optimizer: compression starts afresh, with the warning
    return b.reducer.error_feedback.keys() == [] and a.reducer.error_feedback.keys() != []


def test_torch_layout_load_into_a_fresh_optimizer_warns_that_compression_starts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="dtlab"):
        assert run_world(2, _torch_layout_reload) == [True, True]
    warned = [
        r.getMessage() for r in caplog.records if "restored the torch optimizer state only" in r.getMessage()
    ]
    assert len(warned) == 1 and "sharded_state_dict()" in warned[0], warned


def _load_after_a_raised_backward(backend: CommunicationBackend) -> str:
    """A backward that raised partway (after two buckets went through TopkA), cleaned up by zero_grad(),
    then opt.load_state_dict(): what it raised on this rank ("" when nothing)."""
    a = _build(backend, TopkA(density=0.1, warmup_steps=0), False)
    for s in range(2):
        _step(a, backend, s)
    saved = a.state_dict()

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("a bad batch")

    hook = a.model.module[1].register_forward_hook(lambda m, i, o: o.register_hook(boom) and None)
    g = torch.Generator().manual_seed(5)
    try:
        a.model.train_step(
            (torch.randn(16, 16, generator=g), torch.randint(0, 3, (16,), generator=g)),
            nn.functional.cross_entropy,
        )
    except RuntimeError:
        pass
    hook.remove()
    a.zero_grad()
    try:
        a.load_state_dict(saved)
    except Exception as exc:  # reported back to compare the ranks
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_torch_layout_load_after_a_raised_backward_does_the_same_on_every_rank() -> None:
    """The warning's decision reads the iteration counts every rank holds alike: no rank raises where
    another goes on (before, rank 0 alone read the refused state_dict() and raised)."""
    assert run_world(2, _load_after_a_raised_backward, timeout=60) == ["", ""]


# ---------------------------------------------------------------- the generic encoding
def test_state_encoding_round_trips_and_refuses_what_json_cannot_hold() -> None:
    gen = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {
        "t": 3,
        "thr": 0.1 + 0.2,
        "neg_inf": -math.inf,
        "none": None,
        "flag": True,
        "bounds": [0, 5, 9],
        "pair": (1, torch.arange(3)),
        "nested": {"q": torch.ones(2, 2, dtype=torch.float64)},
        "gen": gen,
        "work": Magnitudes(),
    }
    tensors: dict[str, torch.Tensor] = {}
    doc = encode_state(state, "state.b0/", tensors)
    assert "work" not in doc and doc["thr"] == 0.1 + 0.2 and doc["neg_inf"] == {"float": "-inf"}
    back = decode_state(doc, tensors, torch.device("cpu"))
    assert back["t"] == 3 and back["thr"] == state["thr"] and back["neg_inf"] == -math.inf
    assert back["none"] is None and back["flag"] is True and back["bounds"] == [0, 5, 9]
    assert isinstance(back["pair"], tuple) and torch.equal(back["pair"][1], torch.arange(3))
    assert back["nested"]["q"].dtype == torch.float64 and torch.equal(back["nested"]["q"], torch.ones(2, 2))
    assert torch.equal(torch.rand(4, generator=back["gen"]), torch.rand(4, generator=gen))

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"'state\.b0/x' holds a Opaque.*Workspace"):
        encode_state({"x": Opaque()}, "state.b0/", {})
    assert encode_state({"x": type("Scratch", (Workspace,), {})()}, "p/", {}) == {}
    with pytest.raises(CheckpointError, match="missing from the shard"):
        decode_state({"q": {"tensor": "state.b0/q"}}, {}, torch.device("cpu"))
