"""The two models of the strategies benchmark (``dtlab.benchmarks.strategies``): a ~10M-parameter MLP
and a small decoder-only transformer, each with its FSDP unit class, a batch maker and its loss."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from dtlab.core import seeded_init

__all__ = ["TinyGPT", "build", "loss_fn", "make_mlp"]


def make_mlp() -> nn.Module:
    """1024 -> 2048 -> 2048 -> 1024 -> 1024: 9.45M parameters."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
        nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1024),
    )  # fmt: skip


class TinyGPT(nn.Module):
    """Decoder-only transformer: 4 pre-norm layers of width 256, 4 heads, vocabulary 4096 (5.3M params)."""

    def __init__(
        self, vocab: int = 4096, dim: int = 256, layers: int = 4, heads: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return cast(torch.Tensor, self.head(self.norm(h)))


def build(model: str) -> tuple[nn.Module, type[nn.Module], Any]:
    """The module (same values on every rank), its FSDP unit class and a batch maker."""
    if model == "mlp":

        def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(1000 * rank + step)
            return torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)

        with seeded_init(0):
            return make_mlp(), nn.Linear, mlp_batch

    def gpt_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, 4096, (8, 65), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    with seeded_init(0):
        return TinyGPT(), nn.TransformerEncoderLayer, gpt_batch


def loss_fn(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model == "mlp":
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
