"""Dropout under tensor parallelism: between a column-parallel layer and its row-parallel partner each tp
rank holds other heads or hidden units, so it draws masks of its own (Megatron-LM's model-parallel RNG
stream); where the activations are whole (the residual stream) every tp rank still draws the same mask.

Before, every tp rank drew the same split-region masks: head h on rank 0 and head h + H/2 on rank 1 agreed
at 100% of positions (the built-in transformer, 4 heads at tp=2, attention dropout 0.1; an MLP's hidden
units alike); independent masks agree at p^2 + (1-p)^2 (0.82 at p=0.1). Now 0.819 there. On in-memory
ranks with their training generators (``RankDraws``, as ``dtlab train`` gives them; launched processes
seeded alike draw the same masks). Resume with dropout at tp=2: tests/test_resume_exact.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.core.torch_private import top_dispatch_mode
from dtlab.models import TensorParallelModel, transformer_plan
from dtlab.models.checkpointing import checkpoint_modules
from dtlab.testing import run_world
from dtlab.trainers.rank_draws import RankDraws
from dtlab.zoo.builtin import Block, TransformerLM

SEQ, SEED = 32, 7


class Masks(TorchDispatchMode):
    """Records every Bernoulli draw (a dropout mask) of its thread."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func).startswith("aten.bernoulli"):
            self.masks.append(out.detach().clone())
        return out


def _lm(dropout: float, checkpointed: bool = False) -> nn.Module:
    with seeded_init(0):
        lm = TransformerLM(d_model=32, n_layers=1, n_heads=4, seq_len=SEQ, dropout=dropout)
    if checkpointed:
        checkpoint_modules(lm, (Block,))
    return lm


def _ids() -> torch.Tensor:
    return torch.randint(64, (4, SEQ), generator=torch.Generator().manual_seed(1))


def _forward(model: nn.Module, x: torch.Tensor, draws: RankDraws) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rec = Masks()
    with rec, draws():
        out = model(x)
    return out, rec.masks


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the built-in transformer: attention dropout (SDPA's dropout_p) split, the residual's replicated
    model = TensorParallelModel(_lm(0.1), backend, plan=transformer_plan())
    _, out["lm"] = _forward(model, _ids(), RankDraws(SEED, backend.rank, 2))
    _, out["lm again"] = _forward(model, _ids(), RankDraws(SEED, backend.rank, 2))
    # an MLP: nn.Dropout on the split hidden units, then on the whole output
    with seeded_init(0):
        mlp = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8), nn.Dropout(0.5))
    model = TensorParallelModel(mlp, backend, plan={"0": "colwise", "2": "rowwise"})
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    _, out["mlp"] = _forward(model, x, RankDraws(SEED, backend.rank, 2))
    # no dropout: nothing drawn, the training forward is the evaluation forward bit for bit
    model = TensorParallelModel(_lm(0.0), backend, plan=transformer_plan())
    draws = RankDraws(SEED, backend.rank, 2)
    state = draws.generator.get_state()
    trained, masks = _forward(model, _ids(), draws)
    out["undropped"] = (masks, torch.equal(draws.generator.get_state(), state))
    model.eval()
    with torch.no_grad():
        out["undropped"] += (torch.equal(trained.detach(), model(_ids())),)
    # activation checkpointing: the recomputation in backward draws the forward's masks again
    model = TensorParallelModel(_lm(0.1, checkpointed=True), backend, plan=transformer_plan())
    rec = Masks()
    with rec, RankDraws(SEED, backend.rank, 2)():
        model.cross_entropy(model(_ids()), _ids()).backward()
    out["checkpointed"] = rec.masks
    return out


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def test_split_regions_draw_each_tp_ranks_own_masks_replicated_ones_the_same() -> None:
    rank0, rank1 = run_world(2, _world, timeout=120)
    # the built-in transformer: attention probabilities [batch, heads of this rank, s, s], then residual
    (attn0, *resid0), (attn1, *resid1) = rank0["lm"], rank1["lm"]
    assert attn0.shape == (4, 2, SEQ, SEQ) and len(resid0) == 2
    agree = _agreement(attn0, attn1)
    assert 0.78 < agree < 0.86, agree  # 1.0 before; independent masks: 0.1^2 + 0.9^2 = 0.82
    assert all(torch.equal(a, b) for a, b in zip(resid0, resid1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(rank0["lm"], rank0["lm again"], strict=True))  # seeded
    # the MLP: the hidden units' masks independent (p = 0.5: agreement 0.5), the output's equal
    (hidden0, whole0), (hidden1, whole1) = rank0["mlp"], rank1["mlp"]
    assert hidden0.shape == (16, 32) and 0.42 < _agreement(hidden0, hidden1) < 0.58
    assert torch.equal(whole0, whole1)
    for res in (rank0, rank1):
        masks, untouched, same = res["undropped"]
        assert masks == [] and untouched and same
        drawn = res["checkpointed"]  # the forward's 3 masks, then the recomputation's
        assert len(drawn) == 6 and all(torch.equal(a, b) for a, b in zip(drawn[:3], drawn[3:], strict=True))
    assert 0.78 < _agreement(rank0["checkpointed"][0], rank1["checkpointed"][0]) < 0.86


def _regions(backend: CommunicationBackend) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for p in (0.0, 0.5):
        with seeded_init(0):
            mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 8))
        model = TensorParallelModel(mlp, backend, plan={"0": "colwise", "3": "rowwise"})
        modes = seen[f"p={p}"] = []
        mlp[1].register_forward_hook(lambda *_, m=modes: m.append(type(top_dispatch_mode()).__name__))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
        draws = RankDraws(SEED, backend.rank, 2)
        for _ in range(3):
            with draws():
                model(x)
    return seen


def test_a_region_whose_first_training_pass_drew_nothing_is_not_opened_again() -> None:
    # before: every training forward of every split region ran under the region's dispatch mode, which
    # sees every op (tp=2 host time per step of a small TransformerLM without dropout: +12.5%)
    for seen in run_world(2, _regions, timeout=60):
        assert seen["p=0.0"][0] == "_SplitMode" and "_SplitMode" not in seen["p=0.0"][1:], seen
        assert seen["p=0.5"] == ["_SplitMode"] * 3, seen
