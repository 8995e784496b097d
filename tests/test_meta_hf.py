"""A Hugging Face LlamaForCausalLM built on the meta device (``torch.device("meta")``: its rotary
buffers too) and wrapped with ``init_seed`` alone: the model's own ``_init_weights`` initializes each
rank's part (linear and embedding weights normal(0, initializer_range), norms ones), the rotary
``inv_freq`` is recomputed exactly (equal to a plainly built model's), the values do not depend on the
strategy or the world size (tensor parallel 2 and ZeRO-3 hold the same model), and it trains; GPT-2's
tied head stays one weight."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hf_cases import (
    LLAMA_PLAN,
    SEQ,
    VOCAB,
    decoder_layer,
    gpt2,
    gpt2_wrapped_on_meta,
    llama,
    lm_loss,
    token_batch,
    train_steps,
)
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.models import TensorParallelModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2) -> nn.Module:
    return llama(hidden=32, intermediate=64, layers=layers, heads=4, kv_heads=2)


def _rotary(net: nn.Module) -> dict[str, torch.Tensor]:
    rotary = net.get_submodule("model.rotary_emb")
    return {n: b.clone() for n, b in rotary.named_buffers()}


def _on_meta(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # one batch on every rank: the ranks of a tp group must be given the same batch (refused otherwise)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for wrap in ("tp2", "zero3"):
        with torch.device("meta"):
            net = _llama()
        out[f"{wrap}/meta_buffers"] = [n for n, b in net.named_buffers() if b.is_meta]  # before wrapping
        if wrap == "tp2":
            model: Any = TensorParallelModel(net, backend, plan=LLAMA_PLAN, init_seed=11)
            opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        else:
            model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=11)
            opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
        out[f"{wrap}/rotary"] = _rotary(net)
        out[f"{wrap}/state"] = model.full_state_dict()
        logits = model(ids[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        out[f"{wrap}/loss"] = loss.item()
    return out


def test_llama_on_meta_gets_its_own_init_and_exact_rotary_buffers() -> None:
    plain = _rotary(_llama())
    results = run_world(2, _on_meta)
    for rank, res in enumerate(results):
        for wrap in ("tp2", "zero3"):
            where = f"{wrap} rank {rank}"
            assert "model.rotary_emb.inv_freq" in res[f"{wrap}/meta_buffers"], where  # built on meta
            rotary = res[f"{wrap}/rotary"]
            assert sorted(rotary) == sorted(plain), where
            for n, b in plain.items():
                assert torch.equal(rotary[n], b), (where, n)  # exact, not uninitialized memory
            state = res[f"{wrap}/state"]
            linear = torch.cat([v.flatten() for k, v in state.items() if k.endswith("proj.weight")])
            assert 0.018 < float(linear.std()) < 0.022, where  # normal(0, initializer_range=0.02)
            assert abs(float(state["model.embed_tokens.weight"].std()) - 0.02) < 0.003, where
            assert torch.equal(state["model.norm.weight"], torch.ones(32)), where
            assert abs(res[f"{wrap}/loss"] - math.log(VOCAB)) < 0.05, where  # near-uniform logits
        # the strategy and the world size do not change the values: TP 2 holds ZeRO-3's model
        tp, z3 = res["tp2/state"], res["zero3/state"]
        assert sorted(tp) == sorted(z3)
        assert [k for k in tp if not torch.equal(tp[k], z3[k])] == [], rank


def _gpt2() -> nn.Module:
    return gpt2()


def test_gpt2_tied_head_on_meta_is_one_weight_under_every_strategy() -> None:
    """GPT-2's head tied to its token embedding, built on meta: under tensor parallelism (vocabulary-
    and column-parallel, one shard) and ZeRO-3 the tie stays, and both hold the same values."""
    from dtlab.models import gpt2_plan

    def body(backend: CommunicationBackend) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for wrap in ("tp2", "zero3"):
            with torch.device("meta"):
                net = _gpt2()
            if wrap == "tp2":
                model: Any = TensorParallelModel(net, backend, plan=gpt2_plan(), init_seed=1)
            else:
                model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=1)
            head, embedding = net.get_submodule("lm_head"), net.get_submodule("transformer.wte")
            out[f"{wrap}/tied"] = head.weight is embedding.weight
            out[f"{wrap}/state"] = model.full_state_dict()
        return out

    for res in run_world(2, body):
        assert res["tp2/tied"] and res["zero3/tied"]
        tp, z3 = res["tp2/state"], res["zero3/state"]
        assert [k for k in z3 if not torch.equal(tp[k], z3[k])] == []
        assert abs(float(tp["transformer.h.0.attn.c_attn.weight"].std()) - 0.02) < 0.003


def test_gpt2_on_meta_under_a_pipeline_keeps_its_tie_across_ranks() -> None:
    """GPT-2 split over 2 pipeline ranks (wte on the first, the tied lm_head on the last), built on meta:
    both copies get the embedding's values (the tied parameter is initialized once, by its first
    module, on every rank), the same model as ZeRO-3 from meta; under DDP-like and FSDP data
    parallelism it trains as one process from those values (rel <= 1e-5) and the copies stay equal."""
    from dtlab.backends import Mesh
    from dtlab.models import HybridShardedModel, PipelineParallelModel

    x, y = token_batch(4, seed=5)

    def body(backend: CommunicationBackend) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with torch.device("meta"):
            net = _gpt2()
        out["zero3"] = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=2).full_state_dict()
        for wrap in ("pp", "pp-fsdp"):
            with torch.device("meta"):
                net = _gpt2()
            points = ["transformer.h.1"]
            if wrap == "pp":
                model: Any = PipelineParallelModel(
                    net, backend, micro_batches=2, split_points=points, init_seed=2
                )
                opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.5)
            else:
                mesh = Mesh(backend, {"pp": 2})
                model = HybridShardedModel(
                    net, mesh, "fsdp", micro_batches=2, split_points=points, init_seed=2
                )
                opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5)
            out[f"{wrap}/initial"] = model.full_state_dict()
            losses = []
            for _ in range(2):
                losses.append(model.train_step((x, y), lm_loss).item())
                opt.step()
                opt.zero_grad()
            out[f"{wrap}/losses"] = losses
            out[f"{wrap}/copies"] = [
                q.detach().clone()
                for n, q in model.module.named_parameters(remove_duplicate=False)
                if n in ("transformer.wte.weight", "lm_head.weight")
            ]
        return out

    results = run_world(2, body)
    initial = results[0]["zero3"]
    reference = _gpt2()
    reference.load_state_dict(initial)
    ref_losses = train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.5), x, y, 2)
    last = reference.get_submodule("lm_head").weight.detach()
    for res in results:
        for wrap in ("pp", "pp-fsdp"):
            got = res[f"{wrap}/initial"]
            assert [k for k in initial if not torch.equal(got[k], initial[k])] == [], wrap
            assert res[f"{wrap}/losses"] == pytest.approx(ref_losses, rel=1e-5), wrap
    for wrap in ("pp", "pp-fsdp"):
        first, second = results[0][f"{wrap}/copies"][0], results[1][f"{wrap}/copies"][0]
        if wrap == "pp":  # FSDP holds shards at rest: the whole copies are checked under DDP
            assert torch.equal(first, second), wrap
            torch.testing.assert_close(first, last, rtol=1e-5, atol=1e-6)


def test_llama_on_meta_under_dp2_tp2_pp2_is_the_same_model() -> None:
    """HF Llama built on meta under dp2 x tp2 x pp2 (its own tensor plan, split at a decoder layer,
    FSDP per decoder layer over dp): every rank holds its part of the very model ZeRO-3 builds from the
    same seed, and the rotary buffers (replicated on every stage) are exact."""
    from dtlab.backends import Mesh
    from dtlab.models import HybridShardedModel, ModuleClassPolicy

    def body(backend: CommunicationBackend) -> tuple[list[str], dict[str, torch.Tensor]]:
        with torch.device("meta"):
            net = _llama(layers=4)
        reference = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=1).full_state_dict()
        with torch.device("meta"):
            net = _llama(layers=4)
        layer = decoder_layer("llama")
        model = HybridShardedModel(
            net, Mesh(backend, {"pp": 2, "dp": 2, "tp": 2}), "fsdp", tensor_plan="auto", micro_batches=2,
            split_points=["model.layers.2"], wrap_policy=ModuleClassPolicy((layer,)), init_seed=1,
        )  # fmt: skip
        full = model.full_state_dict()
        return [k for k in reference if not torch.equal(full[k], reference[k])], _rotary(net)

    plain = _rotary(_llama(layers=4))
    for differ, rotary in run_world(8, body):
        assert differ == []
        assert all(torch.equal(rotary[n], b) for n, b in plain.items())


def test_gpt2_on_meta_gets_its_residual_scaled_projections_under_every_layout() -> None:
    """GPT-2's attention and MLP redraw their child ``c_proj.weight`` with std initializer_range /
    sqrt(2 * n_layer) (a parent's ``_init_weights`` on its child's tensor, as ``from_config`` does): built
    on meta, ZeRO-3, tensor and pipeline parallelism give that std (not the plain 0.02) and one model."""

    def body(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for wrap in ("zero3", "tp2", "pp2"):
            out[wrap] = gpt2_wrapped_on_meta(wrap, backend, 3, embd=32).full_state_dict()
        return out

    with seeded_init(3):
        plain = gpt2(embd=32).state_dict()
    scaled = [k for k in plain if k.endswith("c_proj.weight")]
    assert len(scaled) == 4
    want = float(torch.cat([plain[k].flatten() for k in scaled]).std())
    assert abs(want - 0.02 / math.sqrt(4)) < 0.0005  # what from_config draws
    for res in run_world(2, body):
        z3 = res["zero3"]
        got = float(torch.cat([z3[k].flatten() for k in scaled]).std())
        assert abs(got - want) < 0.0005, (got, want)
        for wrap in ("tp2", "pp2"):
            assert [k for k in z3 if not torch.equal(res[wrap][k], z3[k])] == [], wrap


def test_parents_that_initialize_their_children_give_from_config_distributions_on_meta() -> None:
    """T5's layers set their projections' std ((d_model * d_kv) ** -0.5 for queries, d_model ** -0.5 for
    the rest) and Mamba's mixer initializes its convolution and projections (one in place, ``/=``),
    each from the parent's ``_init_weights``: built on meta under ZeRO-3 every tensor has the std of
    ``from_config`` (T5 drew the default 1.0; Mamba's build failed writing into a parameter of a child)."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    mamba = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2)

    def builds() -> dict[str, Any]:
        return {
            "t5": lambda: transformers.T5ForConditionalGeneration(config),
            "mamba": lambda: transformers.MambaForCausalLM(mamba),
        }

    def body(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, build in builds().items():
            with torch.device("meta"):
                net = build()
            out[name] = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=4).full_state_dict()
        return out

    res = run_world(2, body)[0]
    for name, build in builds().items():
        with seeded_init(4):
            plain = build().state_dict()
        for k, want in plain.items():
            got = res[name][k]
            if want.numel() >= 512 and want.is_floating_point():  # enough draws for a std within 15%
                ratio = float(got.std()) / float(want.std())
                assert 0.85 < ratio < 1.15, (name, k, float(got.std()), float(want.std()))
            elif not want.is_floating_point() or want.std() == 0:  # e.g. norms' ones, Mamba's D
                assert torch.equal(got, want), (name, k)
        if name == "mamba":  # deterministic: log(1..state_size) per channel
            a_log = "backbone.layers.0.mixer.A_log"
            assert torch.equal(res[name][a_log], plain[a_log])


def test_only_parents_that_initialize_their_children_are_called_again() -> None:
    """A Llama's containers (decoder layers, attention, MLP, the model) initialize nothing of their
    children: building it on meta calls ``_init_weights`` once per module (a dry run on meta) plus once
    per module with tensors of its own, not again for every ancestor of every module."""

    def body(backend: CommunicationBackend) -> tuple[int, int]:
        calls: list[int] = []
        with torch.device("meta"):
            net = _llama(layers=8)
        for model in [m for m in net.modules() if hasattr(m, "config") and hasattr(m, "_init_weights")]:
            init = getattr(model, "_init_weights")  # noqa: B009 - Hugging Face's, wrapped to count calls

            def counted(module: nn.Module, init: Any = init) -> None:
                calls.append(id(module))
                init(module)

            setattr(model, "_init_weights", counted)  # noqa: B010
        mods = list(net.modules())
        with_own = [m for m in mods if any(True for _ in m.parameters(recurse=False))]
        ZeRO3Model(net, backend, persistence_threshold=0, init_seed=0)
        return len(calls), len(mods) + len(with_own) + 1  # +1: the rotary buffers

    calls, bound = run_world(1, body)[0]
    assert calls <= bound, (calls, bound)
