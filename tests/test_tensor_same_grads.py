"""A parameter the tensor plan leaves whole but that is used on the activations the plan splits gets
only each tp rank's share of its gradient; nothing summed it over tp, so each rank stepped its copy
with another partial gradient and trained on, silently: Qwen3 at tp=2 under its own
``base_model_tp_plan`` without the ``q_norm``/``k_norm`` entries (which Hugging Face marks
``replicated_with_grad_allreduce``) matched one process's losses to 1e-6 while ``q_norm.weight`` was
off by 8e-4 / 1.2e-3 relative on the two tp ranks after 2 SGD steps, the ranks' copies 3.3e-3 apart.
Now the gradients of every parameter left whole are compared over tp after the first synchronized
backward (a fingerprint, one all-reduce) and a difference is refused on every rank, naming the
parameters and the plan entries that fix it; an input-side norm (whole gradient on every rank) is not
refused, and the same scale marked ``replicated_with_grad_allreduce`` trains as one process does.
Also under ZeRO-1, ZeRO-2 and FSDP over dp (the gradients compared from dp shards), with a pipeline (every
stage refuses with the one that found it), for a gradient that is zero at the first step, and with
dropout where the model is not split on in-memory ranks (other masks on each tp rank: named first).
Every rank decides alike: a bf16 parameter lying in one dp rank's ZeRO-2 shard only, its tp ranks'
gradients 0.5% apart (within bf16's tolerance), was judged with float32's on the dp rank holding none
of it, which refused alone while the others went on into the step (a hang on real engines)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hf_cases import SEQ, family, token_batch, train_steps
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.compression import TopkA
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel, TensorParallelModel, transformer_plan
from dtlab.optimizers import (
    DDPOptimizer,
    GradientCompressionOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from dtlab.testing import run_world
from dtlab.zoo import TransformerLM

LR, STEPS, DIM, HEADS, HEAD_DIM = 0.5, 3, 8, 4, 4
FIX = "'replicated_with_grad_allreduce'"


class _HeadScale(nn.Module):
    """One (head_dim,) scale for every head of its input (a per-head norm's weight, without the norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HEAD_DIM, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.unflatten(-1, (-1, HEAD_DIM)) * self.weight).flatten(-2)


class _Block(nn.Module):
    """``x + down(scale(up(norm(x))))``: the norm before the split (whole gradient on every tp rank),
    the scale on the split heads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=torch.float64)
        self.up = nn.Linear(DIM, HEADS * HEAD_DIM, dtype=torch.float64)
        self.scale = _HeadScale()
        self.down = nn.Linear(HEADS * HEAD_DIM, DIM, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.scale(self.up(self.norm(x))))


def _net(zero_down: bool = False) -> nn.Sequential:
    with seeded_init(0):
        net = nn.Sequential(_Block(), _Block())
    if zero_down:  # the scale's gradient is 0 at the first step (down's weight is), partial after
        for block in net:
            nn.init.zeros_(block.down.weight)
    return net


class _Nudge(torch.autograd.Function):
    """The identity, its gradient times ``factor``: a whole parameter's gradient made to differ between
    the tp ranks by a chosen amount."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


class _Nudged(nn.Module):
    """``x * weight`` whose weight's gradient is scaled by ``factor`` (1 unless set per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _Nudge.apply(self.weight, self.factor)


def _bf16_nudged(tp_rank: int) -> nn.Module:
    """bf16: a whole (8,) scale before a colwise/rowwise pair, its gradient 0.5% larger on tp rank 1
    (within bf16's round-off: 2 units of the last place), so ZeRO-2 at dp=2 holds it on one dp rank."""
    with seeded_init(0):
        net = nn.Sequential(_Nudged(), nn.Linear(DIM, 64), nn.Linear(64, DIM)).to(torch.bfloat16)
    net[0].factor = 1.005**tp_rank
    return net


def _plan(marked: tuple[int, ...] = ()) -> dict[str, str]:
    plan = {f"{i}.{n}": s for i in (0, 1) for n, s in (("up", "colwise"), ("down", "rowwise"))}
    return plan | {f"{i}.scale": "replicated_with_grad_allreduce" for i in marked}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, 3, DIM, generator=g, dtype=torch.float64)
    return x, y


def _one_process() -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = _batch()
    train_steps(net, opt, x, y, STEPS, F.mse_loss)
    return net.state_dict()


def _steps(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> str:
    """``STEPS`` steps; the refusal's message (with the step it came at), or ``"trained"``."""
    for step in range(STEPS):
        try:
            F.mse_loss(model(x), y).backward()
        except StrategyError as exc:
            return f"step {step}: {exc}"
        opt.step()
        opt.zero_grad()
    return "trained"


def _tp2_world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = _batch()
    # Qwen3 with its own plan less the q/k norms' entries (the plan a user might write by hand)
    with seeded_init(0):
        qwen3 = family("qwen3")
    hand = {f"model.{k}": v for k, v in qwen3.config.base_model_tp_plan.items() if "norm" not in k}
    model = TensorParallelModel(qwen3, backend, plan=hand)
    ids, targets = token_batch(4, seed=1)
    try:
        train_steps(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), ids, targets, 2)
        out["qwen3"] = "trained"
    except StrategyError as exc:
        out["qwen3"] = str(exc)
    # a plain module: the scale unplanned, then marked; the scale's gradient 0 at the first step
    for key, net, plan in [
        ("plain", _net(), _plan()),
        ("marked", _net(), _plan((0, 1))),
        ("zero first", _net(zero_down=True), _plan()),
    ]:
        model = TensorParallelModel(net, backend, plan=plan)
        backend.stats.reset()
        out[key] = _steps(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), x, y)
        out[key + "/state"] = model.full_state_dict() if out[key] == "trained" else None
    # dropout where the model is not split: in-memory ranks share one generator, so their masks differ
    with seeded_init(0):
        lm = TransformerLM(d_model=16, n_layers=1, n_heads=2, seq_len=SEQ, dropout=0.1)
    model = TensorParallelModel(lm, backend, plan=transformer_plan())
    try:
        train_steps(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), ids, targets, 1, model.cross_entropy)
        out["dropout"] = "trained"
    except StrategyError as exc:
        out["dropout"] = str(exc)
    # the cost, once: the marked model's first synchronized backward against its second
    model = TensorParallelModel(_net(), backend, plan=_plan((0, 1)))
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    out["cost"] = []
    for _ in range(3):
        before = backend.stats.snapshot().get("all_reduce", {"calls": 0, "bytes_sent": 0})
        F.mse_loss(model(x), y).backward()
        after = backend.stats.snapshot()["all_reduce"]
        out["cost"].append((after["calls"] - before["calls"], after["bytes_sent"] - before["bytes_sent"]))
        opt.step()
        opt.zero_grad()
    return out


def test_a_partial_gradient_of_a_whole_parameter_is_refused_on_every_tp_rank() -> None:
    results = run_world(2, _tp2_world, timeout=120)
    ref = _one_process()
    for rank, res in enumerate(results):
        qwen3 = res["qwen3"]
        assert "'model.layers.0.self_attn.q_norm.weight'" in qwen3, (rank, qwen3)
        assert "differ between the ranks of the tensor-parallel group" in qwen3
        assert f"'model.layers.*.self_attn.q_norm': {FIX}" in qwen3
        assert f"'model.layers.*.self_attn.k_norm': {FIX}" in qwen3
        assert "input_layernorm" not in qwen3 and "plan='auto'" in qwen3
        plain = res["plain"]
        assert plain.startswith("step 0: TensorParallelModel: after the synchronized backward"), plain
        assert "'0.scale.weight'" in plain and "'1.scale.weight'" in plain and "norm.weight" not in plain
        assert f"{{'*.scale': {FIX}}}" in plain
        assert "dropout" not in plain and "tp_batch_check" not in plain  # no other cause to name
        assert res["marked"] == "trained"
        for k, v in ref.items():
            assert torch.allclose(res["marked/state"][k], v, rtol=1e-12, atol=1e-12), (rank, k)
        dropout = res["dropout"]
        assert "Possible causes: the tp ranks drew different dropout masks" in dropout, dropout
        assert "(modules ['blocks.0.drop'] have p > 0)" in dropout and "; or if none of these, " in dropout
        assert res["zero first"].startswith("step 1: "), res["zero first"]  # compared again at the 2nd
        assert "'0.scale.weight'" in res["zero first"]
        # the marked model: 2 blocks x (norm weight, bias, down's bias) compared, 48 bytes each, once
        (calls0, sent0), (calls1, sent1), (calls2, sent2) = res["cost"]
        assert (calls0 - calls1, sent0 - sent1) == (1, 6 * 48), res["cost"]
        assert (calls1, sent1) == (calls2, sent2)


def _mesh_world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = _batch()
    ref_x, ref_y = x, y
    for key, axes, dp, driver, marked in [
        ("zero1", {"dp": 2, "tp": 2}, "zero1", ZeRO1Optimizer, ()),  # reduce-scattered over dp
        ("zero2", {"dp": 2, "tp": 2}, "zero2", ZeRO2Optimizer, ()),
        ("fsdp", {"dp": 2, "tp": 2}, "fsdp", ZeRO3Optimizer, ()),
        ("zero2 marked", {"dp": 2, "tp": 2}, "zero2", ZeRO2Optimizer, (0, 1)),
        ("pp", {"pp": 2, "tp": 2}, "ddp", DDPOptimizer, (1,)),
    ]:
        mesh = Mesh(backend, axes)
        model = HybridShardedModel(_net(), mesh, dp, tensor_plan=_plan(marked))
        opt = driver(model, torch.optim.SGD, lr=LR)
        if "pp" in axes:
            try:
                for _ in range(STEPS):
                    model.train_step((ref_x, ref_y), F.mse_loss)
                    opt.step()
                    opt.zero_grad()
                out[key] = "trained"
            except StrategyError as exc:
                out[key] = str(exc)
            continue
        c = mesh.coordinate("dp")
        out[key] = _steps(model, opt, x.chunk(2)[c], y.chunk(2)[c])
        out[key + "/state"] = model.full_state_dict() if out[key] == "trained" else None
    # a bf16 parameter in one dp rank's shard only: every dp rank judges it with bf16's tolerance (the
    # rank not holding a slice of it used float32's and refused alone, the others waiting in the step)
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    split = {"1": "colwise", "2": "rowwise"}
    model = HybridShardedModel(_bf16_nudged(mesh.coordinate("tp")), mesh, "zero2", tensor_plan=split)
    opt = ZeRO2Optimizer(model, torch.optim.SGD, lr=LR)
    units = model.dp_strategy.shard_units()
    out["bf16 held"] = any(slot.name == "0.weight" for u in units for slot, *_ in u.shard_slots())
    c = mesh.coordinate("dp")
    out["bf16"] = _steps(model, opt, x.chunk(2)[c].to(torch.bfloat16), y.chunk(2)[c].to(torch.bfloat16))
    # top-k on the dp axis after a dense warm-up of 2 steps, whose exchanges leave the gradients equal:
    # compared again at the first compressed step (the third), where the whole parameters, compressed
    # apart from the tp shards, are still equal: trains
    model = HybridShardedModel(_net().float(), mesh, "ddp", tensor_plan=_plan((0, 1)))
    inner = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    opt = GradientCompressionOptimizer(inner, TopkA(density=0.1, warmup_steps=2), dense_below=0)
    out["topk"] = _steps(model, opt, x.chunk(2)[c].float(), y.chunk(2)[c].float())
    return out


def test_sharded_over_dp_and_pipelined_every_rank_refuses() -> None:
    """ZeRO-1 (reduce-scatter), ZeRO-2 and FSDP over dp compare the gradients from each dp rank's
    shards; a pipeline's stage without a difference refuses with the one that found it (no rank left
    waiting)."""
    results = run_world(4, _mesh_world, timeout=180)
    ref = _one_process()
    for rank, res in enumerate(results):
        for key in ("zero1", "zero2", "fsdp"):
            assert res[key].startswith("step 0: HybridShardedModel: after the synchronized"), (rank, key)
            assert "'0.scale.weight'" in res[key] and f"{{'*.scale': {FIX}}}" in res[key], (rank, key)
        assert res["zero2 marked"] == "trained"
        for k, v in ref.items():
            assert torch.allclose(res["zero2 marked/state"][k], v, rtol=1e-12, atol=1e-12), (rank, k)
        stage = rank // 2  # pp is the outer axis
        want = "'0.scale.weight'" if stage == 0 else "on another pipeline stage"
        assert want in res["pp"], (rank, res["pp"])
        assert res["bf16"] == "trained", (rank, res["bf16"])  # the same decision on every rank
        assert res["topk"] == "trained", (rank, res["topk"])
    assert [res["bf16 held"] for res in results] == [False, False, True, True]  # dp is the outer axis
