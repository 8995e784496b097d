"""Hugging Face calls made on the model after a data-parallel strategy wrapped it, on 2 in-memory ranks:
``resize_token_embeddings`` on the wrapped model replaces the embedding's and the head's ``.data`` by
tensors of another shape, which the strategy's buckets and shards were not laid out for (DDP, ZeRO-1
and ZeRO-2 stopped in backward with autograd's raw size error): refused at the next forward with
gradients, naming the parameter, the call and the fix, under DDP, ZeRO-1/2/3 and FSDP; resized before
wrapping it trains as one process. ``model.module.generate(...)`` under ZeRO-3 and FSDP with prompts
that take a different number of forwards per rank (``max_length`` over prompts of 2 and 3 tokens):
the rank that finished first met the other's next gather with its own next call (a collective mismatch
in memory, a hang under FSDP on Gloo); now both ranks refuse, naming the fixes, and stay usable:
generating inside ``summon_full_params()`` or a fixed number of new tokens gives one process's tokens.
``save_pretrained`` of the wrapped module under ZeRO-3 and FSDP is refused naming Hugging Face's call
with the gathered state, and both that and ``save_pretrained`` inside ``summon_full_params()`` reload
bitwise with ``from_pretrained``. Under tensor parallelism, tp ranks that choose different tokens in
``model.module.generate`` from the same prompts (as ``do_sample=True`` draws on each rank) were told to
shard their data by the dp coordinate; now the refusal names the sampling and the fix.
``inputs_embeds=model.module.get_input_embeddings()(input_ids)`` under FSDP with the embedding in the
model's own unit read its parked stand-ins (NaN loss, silently); now refused naming the fix, and with
the embedding a unit of its own (or under ZeRO-3) it trains as one process. Tiny configs in memory (no
network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_cases import VOCAB, llama, rel_error, token_batch, transformers_module
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import (
    DDPModel,
    FSDPModel,
    HybridShardedModel,
    ModuleClassPolicy,
    TensorParallelModel,
    ZeRO1Model,
    ZeRO2Model,
    ZeRO3Model,
)
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero3": (ZeRO3Model, ZeRO3Optimizer),
    "fsdp": (FSDPModel, ZeRO3Optimizer),
}
GROWN = VOCAB + 8


def _net(resized: bool) -> nn.Module:
    with seeded_init(0):  # the new rows drawn from torch's global RNG too
        net = llama()
        if resized:
            net.resize_token_embeddings(GROWN, mean_resizing=False)
    return net


def _options(name: str) -> dict[str, Any]:
    return {"persistence_threshold": 0} if name == "zero3" else {}


def _resized(backend: CommunicationBackend) -> dict[str, Any]:
    x, _ = token_batch(4, seed=1)
    xs = x.chunk(2)[backend.rank]
    out: dict[str, Any] = {}
    for name, (wrapper, optimizer) in STRATEGIES.items():
        net = _net(resized=False)
        model = wrapper(net, backend, **_options(name))
        net.resize_token_embeddings(GROWN, mean_resizing=False)  # on the wrapped model
        with pytest.raises(StrategyError) as info:
            model(xs, labels=xs).loss.backward()
        out[f"{name}/after"] = str(info.value)
        model = wrapper(_net(resized=True), backend, **_options(name))  # the fix: resized before wrapping
        opt = optimizer(model, torch.optim.SGD, lr=0.5)
        for _ in range(2):
            model(xs, labels=xs).loss.backward()
            opt.step()
            opt.zero_grad()
        out[f"{name}/before"] = model.state_dict()
    return out


def test_resize_token_embeddings_after_wrapping_is_refused_naming_the_fix() -> None:
    ref = _net(resized=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, _ = token_batch(4, seed=1)
    for _ in range(2):  # the mean of the two halves' losses, as the 2 ranks average their gradients
        sum(ref(h, labels=h).loss / 2 for h in x.chunk(2)).backward()
        opt.step()
        opt.zero_grad()
    for res in run_world(2, _resized, timeout=120):
        for name, (wrapper, _) in STRATEGIES.items():
            got = res[f"{name}/after"]
            assert f"{wrapper.__name__}: parameter 'model.embed_tokens.weight' had its .data replaced" in got
            assert f"tensor of shape ({GROWN}, 16), not its ({VOCAB}, 16)" in got, got
            assert "resize_token_embeddings(n) on the wrapped model" in got, got
            assert "hf_model.resize_token_embeddings(n), then wrap" in got, got
            state = res[f"{name}/before"]
            assert max(rel_error(state[k], v) for k, v in ref.state_dict().items()) <= 1e-5, name


def _generated(backend: CommunicationBackend) -> dict[str, Any]:
    x, _ = token_batch(2, seed=3)
    prompt = x[:, : 2 + backend.rank]  # 2 tokens on rank 0, 3 on rank 1
    out: dict[str, Any] = {}
    for name in ("zero3", "fsdp"):
        net = _net(resized=False).eval()
        model = STRATEGIES[name][0](net, backend, **_options(name))
        with torch.no_grad():
            with pytest.raises(StrategyError) as info:  # rank 0 generates one token more
                net.generate(prompt, max_length=7, do_sample=False)
                model.state_dict()
            out[f"{name}/refused"] = str(info.value)
            with model.summon_full_params(writeback=False):  # no collective per forward
                out[f"{name}/summoned"] = net.generate(prompt, max_length=7, do_sample=False)
            out[f"{name}/fixed"] = net.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        out[f"{name}/state"] = model.state_dict()  # in step again
    return out


def _generated_on_a_mesh(backend: CommunicationBackend) -> dict[str, Any]:
    """dp 2 x tp 2, FSDP: prompts of 2 and 3 tokens by the dp coordinate (the same on both tp ranks)."""
    with seeded_init(0):
        net = llama(heads=4, kv_heads=2).eval()
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = HybridShardedModel(net, mesh, "fsdp", tensor_plan="auto")
    x, _ = token_batch(2, seed=3)
    prompt = x[:, : 2 + mesh.coordinate("dp")]
    out: dict[str, Any] = {}
    with torch.no_grad():
        with pytest.raises(StrategyError) as info:
            model.module.generate(prompt, max_length=7, do_sample=False)
            model.state_dict()
        out["refused"] = str(info.value)
        with model.dp_strategy.summon_full_params(writeback=False):
            out["summoned"] = model.module.generate(prompt, max_length=7, do_sample=False)
    return out


def test_generate_with_a_different_number_of_forwards_per_rank_is_refused_on_every_rank() -> None:
    x, _ = token_batch(2, seed=3)
    plain = _net(resized=False).eval()
    with torch.no_grad():
        want = [plain.generate(x[:, : 2 + r], max_length=7, do_sample=False) for r in range(2)]
        fixed = [
            plain.generate(x[:, : 2 + r], max_new_tokens=3, min_new_tokens=3, do_sample=False)
            for r in range(2)
        ]
    assert want[0].shape[1] - 2 != want[1].shape[1] - 3  # a different number of forwards per rank
    results = run_world(2, _generated, timeout=120)
    for rank, res in enumerate(results):
        for name in ("zero3", "fsdp"):
            got = res[f"{name}/refused"]
            assert "the ranks of the data-parallel group are out of step: " in got, got
            assert "model.state_dict()" in got and "model.module.generate(...)" in got, got
            for fix in ("summon_full_params(writeback=False)", "min_new_tokens=n", "synced_gpus=True"):
                assert fix in got, (fix, got)
            assert torch.equal(res[f"{name}/summoned"], want[rank]), name
            assert torch.equal(res[f"{name}/fixed"], fixed[rank]), name
            assert all(torch.equal(v, plain.state_dict()[k]) for k, v in res[f"{name}/state"].items())
    with seeded_init(0):
        plain4 = llama(heads=4, kv_heads=2).eval()
    with torch.no_grad():
        want4 = [plain4.generate(x[:, : 2 + c], max_length=7, do_sample=False) for c in range(2)]
    for rank, res in enumerate(run_world(4, _generated_on_a_mesh, timeout=120)):
        assert "model.dp_strategy.summon_full_params(...)" in res["refused"], res["refused"]
        assert torch.equal(res["summoned"], want4[rank // 2]), rank  # world rank = dp * 2 + tp


def _saved(backend: CommunicationBackend, root: Path) -> dict[str, str]:
    out = {}
    main = backend.rank == 0
    for name in ("zero3", "fsdp"):
        net = _net(resized=False)
        model = STRATEGIES[name][0](net, backend, **_options(name))
        with pytest.raises(StrategyError) as info:
            net.save_pretrained(root / f"{name}-module", is_main_process=main)
        out[name] = str(info.value)
        state = model.state_dict()  # collective: every rank
        net.save_pretrained(root / f"{name}-state", state_dict=dict(state), is_main_process=main)
        with model.summon_full_params(writeback=False):
            net.save_pretrained(root / f"{name}-summoned", is_main_process=main)
    return out


def test_save_pretrained_under_zero3_and_fsdp_is_refused_on_a_part_and_reloads_bitwise_gathered(
    tmp_path: Path,
) -> None:
    transformers = transformers_module()
    want = _net(resized=False).state_dict()
    for name, got in run_world(2, _saved, tmp_path, timeout=120)[0].items():
        assert "(which Hugging Face's save_pretrained() calls) would be empty tensors" in got, got
        assert "hf_model.save_pretrained(path, state_dict=state, is_main_process=rank == 0)" in got, got
        for how in ("state", "summoned"):
            back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"{name}-{how}")
            assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items()), (name, how)


class _Forced:
    """A logits processor choosing ``token`` at every step (each tp rank its own: as sampling draws)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, _ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        out[:, self.token] = 0.0
        return out


def _sampled_apart(backend: CommunicationBackend) -> str:
    transformers = transformers_module()
    net = _net(resized=False).eval()
    TensorParallelModel(net, backend, plan="auto")
    x, _ = token_batch(2, seed=3)
    chosen = transformers.LogitsProcessorList([_Forced(3 + backend.rank)])
    with torch.no_grad(), pytest.raises(StrategyError) as info:  # the same prompts on both tp ranks
        net.generate(x[:, :3], max_new_tokens=3, do_sample=False, logits_processor=chosen)
    return str(info.value)


def test_tp_ranks_choosing_different_tokens_in_generate_are_told_to_seed_alike() -> None:
    for got in run_world(2, _sampled_apart, timeout=60):
        assert "tensor-parallel group were given different inputs" in got, got
        assert "the tp ranks chose different ones (do_sample=True" in got, got
        assert "torch.manual_seed(seed) in each process" in got, got


def _embedded(model: Any, x: torch.Tensor) -> Any:
    """Hugging Face's inputs_embeds habit: the model's own embedding, then the model on its output."""
    return model(inputs_embeds=model.module.get_input_embeddings()(x))


def _inputs_embeds(backend: CommunicationBackend, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    layer = transformers_module().models.llama.modeling_llama.LlamaDecoderLayer
    x, y = token_batch(4, seed=4)
    xs, ys = x.chunk(2)[backend.rank], y.chunk(2)[backend.rank]
    out: dict[str, Any] = {}
    for name, units in (("fsdp", (layer,)), ("fsdp-embedding-unit", (layer, nn.Embedding)), ("zero3", None)):
        net = _net(False)
        net.load_state_dict(state)
        if units is None:
            model: Any = ZeRO3Model(net, backend, persistence_threshold=0)
        else:
            model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy(units))
        if name == "fsdp":  # the embedding in the model's own unit: it read NaN stand-ins, silently
            with pytest.raises(StrategyError) as info:
                _embedded(model, xs)
            out[name] = str(info.value)
            continue
        opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5)
        for _ in range(2):
            logits = _embedded(model, xs).logits
            F.cross_entropy(logits.reshape(-1, VOCAB), ys.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        out[name] = model.state_dict()
    return out


def test_inputs_embeds_from_the_models_embedding_under_fsdp_trains_or_is_refused_naming_the_fix() -> None:
    state = {k: v.clone() for k, v in _net(False).state_dict().items()}
    one = _net(False)
    one.load_state_dict(state)
    opt = torch.optim.SGD(one.parameters(), lr=0.5)
    x, y = token_batch(4, seed=4)
    for _ in range(2):
        logits = one(inputs_embeds=one.get_input_embeddings()(x)).logits
        F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    for r in run_world(2, _inputs_embeds, state, timeout=120):
        assert (
            "'model.embed_tokens' (Embedding) was called on its own, outside the wrapper's forward, while "
            "its parameters are sharded in the wrapped model's own unit" in r["fsdp"]
        )
        assert "ModuleClassPolicy((..., nn.Embedding))" in r["fsdp"]
        for name in ("fsdp-embedding-unit", "zero3"):
            assert max(rel_error(r[name][k], v) for k, v in one.state_dict().items()) < 1e-5, name
