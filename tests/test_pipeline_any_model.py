"""Pipelines for any model: Hugging Face Llama and GPT-2 (tied) split at module names, under every
schedule, against single-process AdamW on the same global batch (float64); the tied copies bitwise
equal after every step; what the split refuses, named. Tiny configs in memory (no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_cases import SEQ, VOCAB, gpt2, llama, lm_loss, token_batch, train_steps, worst_loss_error
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, PipelineParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

transformers = pytest.importorskip("transformers")

BATCH, STEPS, LR = 8, 3, 1e-2
LLAMA_POINTS = {2: ["model.layers.2"], 4: ["model.layers.1", "model.layers.2", "model.layers.3"]}
GPT2_POINTS = {2: ["transformer.h.1"], 4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"]}


def _llama() -> nn.Module:
    return llama(layers=4, use_cache=False).double()


def _gpt2() -> nn.Module:
    net = gpt2(layers=4, use_cache=False).double()
    assert net.lm_head.weight is net.transformer.wte.weight
    return net


MODELS = {"llama": (_llama, LLAMA_POINTS), "gpt2": (_gpt2, GPT2_POINTS)}


def initial(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    net = MODELS[name][0]()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def build(name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    net = MODELS[name][0]()
    net.load_state_dict(state)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(BATCH, seed=1)


def reference(name: str, state: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = build(name, state)
    x, y = batch()
    losses = train_steps(net, torch.optim.AdamW(net.parameters(), lr=LR), x, y, STEPS)
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tied_equal(model: HybridShardedModel) -> bool:
    """Every tied pair of the whole model bitwise equal, each copy read from the rank holding it
    (collective: the whole state gathered over pp, tp and dp)."""
    full = model.full_state_dict()
    return all(torch.equal(full[alias], full[first]) for alias, first in model._layout.aliases.items())


def _pipeline(backend: CommunicationBackend, name: str, state: dict[str, torch.Tensor], schedule: str) -> Any:
    v = 2 if schedule == "interleaved_1f1b" else 1
    model = PipelineParallelModel(
        build(name, state), backend, schedule, micro_batches=4, split_points=MODELS[name][1][2 * v],
        stages_per_rank=v,
    )  # fmt: skip
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=LR)
    x, y = batch()
    losses, tied = [], []
    for _ in range(STEPS):
        losses.append(model.train_step((x, y), lm_loss).item())
        opt.step()
        opt.zero_grad()
        tied.append(_tied_equal(model))
    return {"losses": losses, "state": model.full_state_dict(), "tied": tied, "ties": len(model._layout.ties)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_split_at_module_names_matches_one_process(name: str, schedule: str) -> None:
    state = initial(name)
    ref_losses, ref_state = reference(name, state)
    out = run_world(2, _pipeline, name, state, schedule, timeout=120)
    for r in out:
        assert worst_loss_error(r["losses"], ref_losses) <= 1e-5
        assert set(r["state"]) == set(ref_state)
        assert max(rel(r["state"][k], ref_state[k]) for k in ref_state) <= 1e-5
        assert all(r["tied"]), "the copies of a tied weight differ after a step"
        assert r["ties"] == (1 if name == "gpt2" else 0)
        assert r["ties"] == (1 if name == "gpt2" else 0)


OPTIMIZERS = {"fsdp": ZeRO3Optimizer, "zero1": ZeRO1Optimizer, "ddp": DDPOptimizer}


def _hybrid(
    backend: CommunicationBackend, name: str, state: dict[str, torch.Tensor], axes: dict[str, int], dp: str
) -> Any:
    mesh = Mesh(backend, axes)
    model = HybridShardedModel(
        build(name, state), mesh, dp, tensor_plan="auto" if mesh.size("tp") > 1 else None,
        schedule="1f1b", micro_batches=2, split_points=MODELS[name][1][2],
    )  # fmt: skip
    opt = OPTIMIZERS.get(dp, ZeRO2Optimizer)(model, torch.optim.AdamW, lr=LR)
    x, y = batch()
    c, n = mesh.coordinate("dp"), mesh.size("dp")
    losses, tied = [], []
    for _ in range(STEPS):
        losses.append(model.train_step((x.chunk(n)[c], y.chunk(n)[c]), lm_loss).item())
        opt.step()
        opt.zero_grad()
        tied.append(_tied_equal(model))
    return {"losses": losses, "state": model.full_state_dict(), "tied": tied, "ties": len(model._layout.ties)}


@pytest.mark.parametrize(
    ("name", "axes", "dp"),
    [
        ("llama", {"pp": 2, "dp": 2, "tp": 2}, "fsdp"),
        ("llama", {"pp": 2, "dp": 2, "tp": 2}, "zero1"),
        ("gpt2", {"pp": 2, "dp": 2, "tp": 2}, "fsdp"),
        ("gpt2", {"pp": 2, "dp": 2, "tp": 2}, "zero1"),
        ("gpt2", {"pp": 2, "dp": 2}, "ddp"),
        ("gpt2", {"pp": 2, "dp": 2}, "zero2"),
    ],
)
def test_hybrid_split_at_module_names_matches_one_process(name: str, axes: dict[str, int], dp: str) -> None:
    state = initial(name)
    ref_losses, ref_state = reference(name, state)
    world = axes["pp"] * axes["dp"] * axes.get("tp", 1)
    out = run_world(world, _hybrid, name, state, axes, dp, timeout=240)
    losses = [sum(r["losses"][i] for r in out) / len(out) for i in range(STEPS)]  # mean over dp shards
    assert worst_loss_error(losses, ref_losses) <= 1e-5
    for r in out:
        assert max(rel(r["state"][k], ref_state[k]) for k in ref_state) <= 1e-5
        assert all(r["tied"]), "the copies of a tied weight differ after a step"
        assert r["ties"] == (1 if name == "gpt2" else 0)


class _Leaky(nn.Module):
    """The last layer reads the embedding's output directly: a value that would cross stages unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        h = self.layers[0](e)
        h = self.layers[1](h) + e
        out: torch.Tensor = self.head(h)
        return out


class _Glue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def _refused(backend: CommunicationBackend, kind: str) -> None:
    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))  # alike on every rank
    if kind == "leak":
        model = PipelineParallelModel(_Leaky(), backend, micro_batches=2, split_points=["layers.1"])
        model.train_step((x, x), lm_loss)
    elif kind == "glue":
        PipelineParallelModel(_Glue(), backend, micro_batches=2, split_points=["layers.1"])
    elif kind == "unknown":
        PipelineParallelModel(llama(), backend, micro_batches=2, split_points=["model.layer.2"])
    elif kind == "none":
        PipelineParallelModel(llama(), backend, micro_batches=2)
    elif kind == "hidden":  # a loss reading them got the last stage's layers' in the first slots
        net = llama(layers=4, output_hidden_states=True)
        model = PipelineParallelModel(net, backend, micro_batches=2, split_points=["model.layers.2"])
        model.train_step((x, x), lm_loss)
    elif kind == "router":  # a mixture of experts' load-balancing loss over the last stage's layers alone
        model = PipelineParallelModel(
            _mixtral(output_router_logits=True), backend, split_points=["model.layers.1"]
        )
        model.train_step((x, x), lm_loss)
    elif kind == "attentions":  # inference alike
        net = llama(output_attentions=True, attn_implementation="eager")
        model = PipelineParallelModel(net, backend, micro_batches=2, split_points=["model.layers.1"]).eval()
        with torch.no_grad():
            model(x)
    else:
        PipelineParallelModel(llama(), backend, micro_batches=2, split_points=["model.rotary_emb"])


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("leak", "'head' gets 'argument 0' computed from 'emb', a block of an earlier stage"),
        ("glue", "parameters ['scale'] belong to _Glue's glue"),
        ("unknown", "split points ['model.layer.2'] name no module of LlamaForCausalLM"),
        ("none", "stages 1..1 begins: split_points=[1 module name(s)] (dtlab train: parallel.split_points)"),
        ("late", "split points ['model.rotary_emb'] have no parameters"),
        ("hidden", "output holds ['hidden_states'] beside its logits: under a pipeline the loss function"),
        ("attentions", "set hf_model.config.output_attentions = False"),
        ("router", "output holds ['aux_loss', 'router_logits'] beside its logits"),
    ],
)
def test_what_a_split_at_module_names_refuses_is_named(kind: str, says: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(2, _refused, kind, timeout=60)
    assert isinstance(info.value.__cause__, StrategyError), info.value.__cause__
    assert says in str(info.value.__cause__)


def test_dtlab_train_splits_a_llama_factory_at_module_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from dtlab.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
    sets += ["data.global_batch_size=8", "train.eval_every=0", "optimizer.warmup_steps=0", "train.steps=2"]
    sets += ["model.factory=hf_cases:llama", "data.factory=hf_cases:tokens"]
    sets += ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.split_points=[model.layers.1]"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0


def engine_world(backend: CommunicationBackend, states: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Llama and GPT-2 (tied) at pp 2 under 1F1B on a real engine (one spawned world per engine)."""
    return {name: _pipeline(backend, name, state, "1f1b") for name, state in states.items()}


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_pp2_split_at_module_names_on_gloo_and_mpi_processes(engine: str) -> None:
    from dtlab.testing import spawn_world

    if engine == "mpi":
        pytest.importorskip("mpi4py")
    states = {name: initial(name) for name in MODELS}
    refs = {name: reference(name, state) for name, state in states.items()}
    for r in spawn_world(2, engine_world, states, backend=engine, timeout=240):
        for name, (ref_losses, ref_state) in refs.items():
            got = r[name]
            assert worst_loss_error(got["losses"], ref_losses) <= 1e-5
            assert max(rel(got["state"][k], ref_state[k]) for k in ref_state) <= 1e-5
            assert all(got["tied"])


def _saved(backend: CommunicationBackend, state: dict[str, torch.Tensor]) -> Any:
    model = PipelineParallelModel(build("gpt2", state), backend, micro_batches=2, split_points=GPT2_POINTS[2])
    shard = model.sharded_state_dict()
    return {"shard": shard, "keys": set(shard.metadata["entries"])}


def test_a_tied_weight_across_stages_is_stored_once_and_loads_into_the_plain_model() -> None:
    from dtlab.checkpoint.consolidate import full_tensors_from_shards

    state = initial("gpt2")
    out = run_world(2, _saved, state, timeout=120)
    stored = [k for r in out for k in r["keys"] if "lm_head" in k or "wte" in k]
    assert stored and all("lm_head" not in k for k in stored), stored  # once, under its first name
    full = full_tensors_from_shards([r["shard"] for r in out])
    assert torch.equal(full["lm_head.weight"], state["transformer.wte.weight"])
    plain = build("gpt2", initial("gpt2"))
    plain.load_state_dict({k: full[k] for k in plain.state_dict()})
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())


def _mixtral(**extra: Any) -> nn.Module:
    """A tiny Mixtral (4 experts, 2 per token), float32: its experts run torch._grouped_mm."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False, **extra,
    )  # fmt: skip
    with seeded_init(0):
        net: nn.Module = transformers.MixtralForCausalLM(config)
    return net


def _mixtral_pp(backend: CommunicationBackend) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = PipelineParallelModel(_mixtral(), backend, micro_batches=2, split_points=["model.layers.1"])
    opt = DDPOptimizer(model, torch.optim.SGD, lr=0.5)
    x, y = batch()
    losses = []
    for _ in range(2):
        losses.append(model.train_step((x, y), lm_loss).item())
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def test_a_mixture_of_experts_split_at_module_names_trains_as_one_process() -> None:
    """The trace ran the model on broadcast zeros, which torch._grouped_mm refuses for a stacked experts'
    weight: Mixtral under a pipeline was refused ('Invalid strides/sizes, got [0, 0, 0]')."""
    net = _mixtral()
    x, y = batch()
    want = train_steps(net, torch.optim.SGD(net.parameters(), lr=0.5), x, y, 2)
    for losses, state in run_world(2, _mixtral_pp, timeout=120):
        assert worst_loss_error(losses, want) <= 1e-5
        assert max(rel(state[k], v) for k, v in net.state_dict().items()) <= 1e-5


class _Experts(nn.Module):
    """A stacked experts' weight ``(experts, d, d)``, every expert run on the input and summed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.expand(2, *x.shape), self.w).sum(0).tanh()


class _Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Experts() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _stand_ins_traced(backend: CommunicationBackend) -> int:
    """The most zero matrices one forward of the trace gave the 4 layers' stacked weights (a stand-in
    holds one matrix, not its experts')."""
    with seeded_init(0):
        net = _Stacked()
    calls: list[set[int]] = []

    def seen(m: nn.Module, _args: Any) -> None:
        if isinstance(m, _Stacked):  # the model, or a stage's copy of its glue
            calls.append(set())
        elif m.w.untyped_storage().nbytes() < m.w.nbytes:  # a stand-in
            calls[-1].add(m.w.untyped_storage().data_ptr())

    for m in (net, *net.layers):
        m.register_forward_pre_hook(seen)
    model = PipelineParallelModel(net, backend, split_points=["layers.2"], micro_batches=2)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
    model.train_step(batch, nn.functional.mse_loss)
    return max(map(len, calls))


def test_the_trace_of_stacked_weights_holds_one_zero_matrix_per_shape() -> None:
    """Each 3-D weight had a zero matrix of its own in the trace: one per layer (Mixtral-8x7B's 32 layers
    of stacked experts: 11 GB in bfloat16 on every rank, on the batch's device), for values that are
    all zeros."""
    assert run_world(2, _stand_ins_traced, timeout=60) == [1, 1]
