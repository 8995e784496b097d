"""Hugging Face models under tensor parallelism with the plan they declare (``plan="auto"``): a tiny
``LlamaForCausalLM`` (grouped-query attention, its own ``_tp_plan``) and ``GPT2LMHeadModel`` (``Conv1D``
layers, a fused qkv projection, the head tied to the embedding; dtlab's GPT-2 recipe), each against
single-process AdamW on the same global batch (float64), at tp 2 and at dp 2 x tp 2 with FSDP and
ZeRO-1, and at pp 2 x dp 2 x tp 2 (split at a module name) with both; the tied pair stays one weight
(bitwise equal in the gathered state). Tiny configs built in memory (no network)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from hf_cases import (
    VOCAB,
    gpt2,
    llama,
    llama_gqa,
    lm_loss,
    rel_error,
    token_batch,
    train_steps,
    worst_loss_error,
)
from refusals import refusal_messages
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel, TensorParallelModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

BATCH, STEPS = 4, 3


def build(kind: str) -> nn.Module:
    """A tiny model, float64 (Adam's round-off on gradients that are zero in exact arithmetic)."""
    if kind == "llama":  # 4 query heads, 2 key/value heads: each tp=2 rank gets 2 and 1
        return llama(hidden=32, intermediate=48, heads=4, kv_heads=2).double()
    return gpt2(heads=4).double()


def reference(kind: str, state: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = build(kind)
    net.load_state_dict(state)
    x, y = token_batch(BATCH, seed=0)
    losses = train_steps(net, torch.optim.AdamW(net.parameters(), lr=1e-2), x, y, STEPS)
    return losses, net.state_dict()


def train(
    backend: CommunicationBackend, kind: str, axes: dict[str, int], dp: str, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    net = build(kind)
    net.load_state_dict(state)
    mesh = Mesh(backend, axes)
    if dp == "tensor":
        model: HybridShardedModel = TensorParallelModel(net, mesh, plan="auto")
    elif "pp" in axes:  # split at a module name of the model (its second decoder layer)
        point = "model.layers.1" if kind == "llama" else "transformer.h.1"
        model = HybridShardedModel(net, mesh, dp, tensor_plan="auto", split_points=[point], micro_batches=2)
    else:
        model = HybridShardedModel(net, mesh, dp, tensor_plan="auto")
    opt = {"fsdp": ZeRO3Optimizer, "zero1": ZeRO1Optimizer}.get(dp, DDPOptimizer)(
        model, torch.optim.AdamW, lr=1e-2
    )
    x, y = token_batch(BATCH, seed=0)
    c, n = mesh.coordinate("dp"), mesh.size("dp")
    xs, ys = x.chunk(n)[c], y.chunk(n)[c]
    losses = []
    for _ in range(STEPS):
        if model.pipelined:
            loss = model.train_step((xs, ys), lm_loss)
        else:
            loss = lm_loss(model(xs), ys)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = model.dp_strategy.module
    # one parameter under tp alone; a pipeline keeps a copy per stage in sync (the gathered state below)
    tied = kind != "gpt2" or model.pipelined or inner.lm_head.weight is inner.transformer.wte.weight
    swapped = {n: type(m).__name__ for n, m in inner.named_modules() if "Parallel" in type(m).__name__}
    return {"losses": losses, "state": model.full_state_dict(), "tied": tied, "swapped": swapped}


#: what plan="auto" swaps in layer 0 (Llama: its own _tp_plan; GPT-2: dtlab's recipe)
SWAPPED = {
    "llama": {
        "model.embed_tokens": "VocabParallelEmbedding",
        "model.layers.0.self_attn.k_proj": "ColumnParallelLinear",
        "model.layers.0.self_attn.o_proj": "RowParallelLinear",
        "model.layers.0.mlp.down_proj": "RowParallelLinear",
        "lm_head": "ColumnParallelLinear",
    },
    "gpt2": {
        "transformer.wte": "VocabParallelEmbedding",
        "transformer.h.0.attn.c_attn": "ColumnParallelLinear",
        "transformer.h.0.attn.c_proj": "RowParallelLinear",
        "transformer.h.0.mlp.c_fc": "ColumnParallelLinear",
        "lm_head": "ColumnParallelLinear",
    },
}


LAYOUTS = [
    ({"tp": 2}, "tensor"),
    ({"dp": 2, "tp": 2}, "fsdp"),
    ({"dp": 2, "tp": 2}, "zero1"),
    ({"pp": 2, "dp": 2, "tp": 2}, "fsdp"),
    ({"pp": 2, "dp": 2, "tp": 2}, "zero1"),
]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize(
    ("axes", "dp"),
    LAYOUTS,
    ids=["tp2", "dp2xtp2-fsdp", "dp2xtp2-zero1", "pp2xdp2xtp2-fsdp", "pp2xdp2xtp2-zero1"],
)
def test_plan_auto_matches_one_process(kind: str, axes: dict[str, int], dp: str) -> None:
    state = {k: v.detach().clone() for k, v in build(kind).state_dict().items()}
    ref_losses, ref = reference(kind, state)
    world = axes.get("pp", 1) * axes.get("dp", 1) * axes["tp"]
    out = run_world(world, train, kind, axes, dp, state, timeout=180)
    losses = [sum(r["losses"][i] for r in out) / len(out) for i in range(STEPS)]  # the dp shards' mean
    assert worst_loss_error(losses, ref_losses) < 1e-5, losses
    swapped = {k: v for r in out for k, v in r["swapped"].items()}  # a pipeline rank holds its stages
    assert SWAPPED[kind].items() <= swapped.items(), swapped
    for r in out:
        for k, v in ref.items():
            if v.is_floating_point():
                assert rel_error(r["state"][k], v) < 1e-5, k
        if kind == "gpt2":  # the tied pair: one parameter, bitwise equal in the gathered state
            assert r["tied"]
            assert torch.equal(r["state"]["lm_head.weight"], r["state"]["transformer.wte.weight"])


def _odd_vocabulary() -> nn.Module:
    net = llama(hidden=32, intermediate=32, layers=1, heads=4, kv_heads=4)
    net.resize_token_embeddings(VOCAB + 1, mean_resizing=False)  # as after adding a token
    return net


def _refusals(backend: CommunicationBackend) -> tuple[list[str], int]:
    cases: list[tuple[nn.Module, Any]] = [
        (llama_gqa(), "auto"),  # tp=4 over 2 key/value heads
        (gpt2(layers=1), "auto"),  # tp=4 over 2 heads
        (llama_gqa(), {"model.embed_tokens": "embedding_colwise"}),
        (nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), "auto"),
        (_odd_vocabulary(), "auto"),  # 33 tokens
    ]
    errors = refusal_messages(partial(TensorParallelModel, net, backend, plan=plan) for net, plan in cases)
    return errors, backend.stats.calls


def test_what_auto_cannot_honour_is_refused_before_any_call() -> None:
    errors, calls = run_world(4, _refusals, timeout=60)[0]
    needles = [
        "'model.layers.0.self_attn.k_proj' projects 2 attention heads of 8",
        "'transformer.h.0.attn.c_attn' projects 2 attention heads of 8 (its module's head_dim; key/value "
        "heads under grouped-query attention), not divisible by tp=4",
        "entry 'model.embed_tokens': style 'embedding_colwise' cannot be honoured exactly",
        "plan='auto': Sequential declares no tensor plan",
        "is 33, not divisible by tp=4; pad the vocabulary to a multiple of 4 "
        "(hf_model.resize_token_embeddings(pad_to_multiple_of=4) before wrapping)",
    ]
    assert len(errors) == len(needles), errors
    for needle, error in zip(needles, errors, strict=True):
        assert needle in error, (needle, error)
    assert calls == 0


def test_a_fused_section_split_along_dim_1_is_flattened_in_local_order() -> None:
    """Conv1D's fused qkv weight ``[in, 3 x out]`` split per section along dim 1: the placed regions of
    a flat range of the local shard are the full tensor's elements at those local positions."""
    from dtlab.core.placement import Shard, local_regions

    full = torch.arange(4 * 12, dtype=torch.float64).reshape(4, 12)
    placement = Shard("tp", 1, sections=3)
    for coord in range(2):
        local = placement.local_shard(full, coord, 2).reshape(-1)
        for start, end in [(0, local.numel()), (3, 17)]:
            got = [
                full[box.slices()].reshape(-1)[bs:be]
                for box, bs, be, _ in local_regions(placement, full.shape, coord, 2, start, end)
            ]
            assert torch.equal(torch.cat(got), local[start:end])


def engine_world(backend: CommunicationBackend, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Llama at tp 2 with its own plan on a real engine (one spawned world per engine); on Gloo also
    ZeRO-3's ``model.module.generate(..., synced_gpus=True)`` with prompts of 2 and 3 tokens per rank
    (``max_length``: a different number of forwards each, kept in step by Hugging Face)."""
    out = train(backend, "llama", {"tp": 2}, "tensor", state)
    got = {"losses": out["losses"], "state": out["state"]}
    if torch.distributed.is_initialized():  # synced_gpus needs torch.distributed's default group
        net = build("llama").eval()
        net.load_state_dict(state)
        ZeRO3Model(net, backend, persistence_threshold=0)
        x, _ = token_batch(BATCH, seed=0)
        with torch.no_grad():
            got["generated"] = net.generate(
                x[:, : 2 + backend.rank], max_length=7, do_sample=False, synced_gpus=True
            )
    return got


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_llama_plan_auto_at_tp2_on_gloo_and_mpi_processes(engine: str) -> None:
    from dtlab.testing import spawn_world

    if engine == "mpi":
        pytest.importorskip("mpi4py")
    state = {k: v.detach().clone() for k, v in build("llama").state_dict().items()}
    ref_losses, ref = reference("llama", state)
    plain = build("llama").eval()
    plain.load_state_dict(state)
    x, _ = token_batch(BATCH, seed=0)
    for rank, r in enumerate(spawn_world(2, engine_world, state, backend=engine, timeout=240)):
        if engine == "gloo":  # one process's tokens for this rank's prompts
            with torch.no_grad():
                want = plain.generate(x[:, : 2 + rank], max_length=7, do_sample=False)
            assert torch.equal(r["generated"], want), (r["generated"], want)
        assert worst_loss_error(r["losses"], ref_losses) < 1e-5
        for k, v in ref.items():
            if v.is_floating_point():
                assert rel_error(r["state"][k], v) < 1e-5, k
