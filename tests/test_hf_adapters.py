"""LoRA by hand on a Hugging Face Llama (base weights frozen, adapters with Linear A and B put around
the attention's q and o projections before wrapping) under tensor parallelism, on 2 in-memory ranks
against one process on the same batch (float64, 3 SGD steps). With a plan naming the wrapped layers
and the adapters' own (q: base and B 'colwise'; o: base and A 'rowwise') it trains as one process; with
an adapter rank equal to the key/value head count (2) it was refused as a table with an entry per
head (LoRA's A weight, (2, 32)), suggesting a style that would have summed its gradient twice. With
``plan="auto"`` (the model's names, now the adapters') the refusal says how to plan them. Tiny configs
in memory (no network)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_cases import LLAMA_PLAN, llama, rel_error, token_batch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world

STEPS, LR = 3, 0.5
ATTN = "model.layers.*.self_attn"
PLAN = {k: v for k, v in LLAMA_PLAN.items() if not k.endswith(("q_proj", "o_proj"))}
PLAN |= {f"{ATTN}.q_proj.base": "colwise", f"{ATTN}.q_proj.lora_B": "colwise"}
PLAN |= {f"{ATTN}.o_proj.base": "rowwise", f"{ATTN}.o_proj.lora_A": "rowwise"}


class LoRA(nn.Module):
    """``base(x) + B(A(x))`` around a frozen ``nn.Linear`` (values from a private generator)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        kw: dict[str, Any] = {"bias": False, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, **kw)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in (self.lora_A, self.lora_B):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def _adapted() -> nn.Module:
    """4 query heads, 2 key/value heads; adapters of rank 2 on q and o."""
    # the adapters inside the block too: their nn.Linear draws from torch's global RNG (then overwritten),
    # and a draw outside it on one in-memory rank would take numbers from another rank's seeded build
    with seeded_init(0):
        net = llama(hidden=32, intermediate=48, heads=4, kv_heads=2).double()
        net.requires_grad_(False)
        for layer in net.model.layers:
            layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj, rank=2)
            layer.self_attn.o_proj = LoRA(layer.self_attn.o_proj, rank=2)
    return net


def _tp(backend: CommunicationBackend) -> dict[str, Any]:
    with pytest.raises(StrategyError) as info:
        TensorParallelModel(_adapted(), backend, plan="auto")
    model = TensorParallelModel(_adapted(), backend, plan=PLAN)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    x, _ = token_batch(4, seed=5)
    for _ in range(STEPS):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"auto": str(info.value), "state": model.state_dict()}


def test_lora_by_hand_under_tp_trains_as_one_process_with_a_plan_naming_the_adapters() -> None:
    ref = _adapted()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    x, _ = token_batch(4, seed=5)
    for _ in range(STEPS):
        ref(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    for res in run_world(2, _tp, timeout=120):
        state = res["state"]
        assert max(rel_error(state[k], v) for k, v in ref.state_dict().items()) <= 1e-9
        assert "'model.layers.0.self_attn.q_proj' is a LoRA" in res["auto"]
        assert "holds the Linear layers ['base', 'lora_A', 'lora_B']" in res["auto"], res["auto"]
        assert "'model.layers.0.self_attn.q_proj.base'" in res["auto"], res["auto"]
