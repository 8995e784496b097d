"""Tied parameters (an embedding and an output layer sharing one weight) under the model-parallel
strategies: kept as one weight where the plan splits both users alike (tp, dp x tp with DDP and FSDP,
against one process), refused before any communication, naming the tied parameters, where it cannot
be kept (a plan splitting only one user). Pipelines keep it tied across stages:
tests/test_pipeline_any_model.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from steps import plain_steps
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

VOCAB, DIM, BATCH, SEQ, STEPS = 16, 8, 4, 6, 3
TIED_PLAN = {"emb": "vocab", "head": "colwise"}


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # one parameter, two users

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mid(self.emb(x)))
        return out

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        return [("emb", self.emb), ("mid", self.mid), ("head", self.head)]


def _model() -> TiedLM:
    return filled(TiedLM(), 0, scale=0.5)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=gen
    )


def _reference() -> tuple[list[float], torch.Tensor]:
    net = _model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    x, y = _batch()
    losses = plain_steps(
        net, opt, [(x, y)] * STEPS, lambda out, t: F.cross_entropy(out.reshape(-1, VOCAB), t.reshape(-1))
    )
    return losses, net.emb.weight.detach().clone()


def _train(backend: CommunicationBackend, axes: dict[str, int], data_parallel: str) -> dict[str, Any]:
    mesh = Mesh(backend, axes)
    model = (
        TensorParallelModel(_model(), mesh, plan=TIED_PLAN)
        if data_parallel == "tensor"
        else HybridShardedModel(
            _model(),
            mesh,
            data_parallel,
            tensor_plan=TIED_PLAN,
            **({"persistence_threshold": 0} if data_parallel == "zero3" else {}),  # shard every tensor
        )
    )
    inner = model.dp_strategy.module
    tied_after_wrap = inner.head.weight is inner.emb.weight
    opt_class = {
        "fsdp": ZeRO3Optimizer,
        "zero3": ZeRO3Optimizer,
        "zero1": ZeRO1Optimizer,
        "zero2": ZeRO2Optimizer,
    }
    opt = opt_class.get(data_parallel, DDPOptimizer)(model, torch.optim.AdamW, lr=0.05)
    x, y = _batch()
    c, dp = mesh.coordinate("dp"), mesh.size("dp")
    xs, ys = x.chunk(dp)[c], y.chunk(dp)[c]
    losses = plain_steps(model, opt, [(xs, ys)] * STEPS, model.cross_entropy)
    full = model.full_state_dict()
    return {
        "tied": tied_after_wrap and inner.head.weight is inner.emb.weight,
        "losses": losses,
        "emb": full["emb.weight"],
        "head": full["head.weight"],
    }


@pytest.mark.parametrize(
    ("axes", "data_parallel"),
    [({"tp": 2}, "tensor"), *(({"dp": 2, "tp": 2}, dp) for dp in ("ddp", "zero1", "zero2", "zero3", "fsdp"))],
)
def test_a_vocab_and_colwise_plan_keeps_the_tie_and_matches_one_process(
    axes: dict[str, int], data_parallel: str
) -> None:
    ref_losses, ref_emb = _reference()
    world = axes.get("dp", 1) * axes["tp"]
    out = run_world(world, _train, axes, data_parallel, timeout=60)
    for r in out:
        assert r["tied"], "the output layer no longer shares the embedding's weight"
        assert torch.equal(r["emb"], r["head"])
        assert ((r["emb"] - ref_emb).norm() / ref_emb.norm()).item() < 1e-5
    # each rank's loss is its dp shard's mean; every dp shard is on tp ranks alike: the rank mean is global
    losses = [sum(r["losses"][i] for r in out) / len(out) for i in range(STEPS)]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (
        losses,
        ref_losses,
    )


def _refused(backend: CommunicationBackend, kind: str) -> None:
    if kind == "tp_one_user":
        TensorParallelModel(_model(), backend, plan={"head": "colwise"})


@pytest.mark.parametrize(("kind", "world", "says"), [("tp_one_user", 2, "ColwiseParallel on 'head'")])
def test_a_tie_that_cannot_be_kept_is_refused_naming_it(kind: str, world: int, says: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(world, _refused, kind, timeout=30)
    err = info.value.__cause__
    assert isinstance(err, StrategyError)
    msg = str(err)
    assert "'emb.weight' and 'head.weight' are one tied parameter" in msg
    assert says in msg
    assert "tie_word_embeddings=False" in msg


def test_refused_before_any_communication() -> None:
    def body(backend: CommunicationBackend) -> int:
        try:
            TensorParallelModel(_model(), backend, plan={"emb": "vocab"})
        except StrategyError:
            return backend.stats.calls
        raise AssertionError("a plan splitting one user of a tied weight was accepted")

    assert run_world(2, body) == [0, 0]


def _gpt2_state() -> tuple[Any, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB * 2, n_positions=SEQ, n_embd=DIM * 2, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    net = transformers.GPT2LMHeadModel(config).double()  # float64: Adam's round-off on zero-init biases
    assert net.lm_head.weight is net.transformer.wte.weight
    return config, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _gpt2(config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    import transformers

    net = transformers.GPT2LMHeadModel(config).double()
    net.load_state_dict(state)
    return net


GPT2_PLAN = {"transformer.wte": "vocab", "lm_head": "colwise"}


def _gpt2_world(backend: CommunicationBackend, config: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = TensorParallelModel(_gpt2(config, state), backend, plan=GPT2_PLAN)
    inner = model.dp_strategy.module
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = _batch()
    losses = plain_steps(model, opt, [(x, y)] * STEPS, lambda out, t: model.cross_entropy(out.logits, t))
    return {
        "tied": inner.lm_head.weight is inner.transformer.wte.weight,
        "losses": losses,
        "state": model.full_state_dict(),
    }


def test_gpt2_tied_head_under_tensor_parallelism_matches_one_process() -> None:
    config, state = _gpt2_state()
    net = _gpt2(config, state)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = _batch()
    ref_losses = plain_steps(
        net,
        opt,
        [(x, y)] * STEPS,
        lambda out, t: F.cross_entropy(out.logits.reshape(-1, VOCAB * 2), t.reshape(-1)),
    )
    ref = net.state_dict()
    for r in run_world(2, _gpt2_world, config, state, timeout=60):
        assert r["tied"]
        assert torch.equal(r["state"]["lm_head.weight"], r["state"]["transformer.wte.weight"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses, strict=True)) < 1e-5
        for k, v in ref.items():
            if v.is_floating_point():
                assert ((r["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item() < 1e-5, k


def _pipeline_groups(backend: CommunicationBackend) -> dict[str, Any]:
    """pp=2, param groups built per stage: the embedding in its own group (lr 0.1) on stage 0, the
    tied head's copy in the default group on stage 1 (refused: the message), then both copies in
    groups of the same options (trains as one process)."""
    model = HybridShardedModel(_model(), Mesh(backend, {"pp": 2}), "ddp", micro_batches=2)
    named = model.trainable_parameters()
    own = [{"params": [p for n, p in named if n == "emb.weight"], "lr": 0.1}]
    try:
        DDPOptimizer(model, torch.optim.AdamW([*own, {"params": [p for n, p in named if n != "emb.weight"]}]))
    except StrategyError as e:
        refused = str(e)
    else:
        return {"refused": ""}  # accepted: the copies would drift apart
    copies = set(model.tied_names()) | set(model.tied_names().values())
    tied = [p for n, p in named if n in copies]
    groups = [{"params": tied, "lr": 0.05}, {"params": [p for n, p in named if n not in copies]}]
    opt = DDPOptimizer(model, torch.optim.AdamW([g for g in groups if g["params"]], lr=0.05))
    for _ in range(STEPS):
        model.train_step(_batch(), model.cross_entropy)
        opt.step()
        opt.zero_grad()
    return {"refused": refused, "emb": model.full_state_dict()["emb.weight"]}


def test_copies_of_a_pipeline_tie_in_groups_of_different_options_are_refused_on_every_rank() -> None:
    _, ref_emb = _reference()
    for r in run_world(2, _pipeline_groups, timeout=120):
        assert "'emb.weight' on rank 0: lr=0.1" in r["refused"]
        assert "'head.weight' on rank 1: lr=0.001" in r["refused"]  # torch's default: no lr given
        assert "same options" in r["refused"]
        torch.testing.assert_close(r["emb"], ref_emb, rtol=1e-5, atol=1e-6)  # equal options: exact
