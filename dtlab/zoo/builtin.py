"""The small models the embedded tasks train: a byte-level causal transformer and a digits CNN."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.models import ColwiseParallel, HeadsParallel, RowwiseParallel, SequenceParallel, VocabParallel

__all__ = [
    "Block",
    "CausalSelfAttention",
    "DigitsCNN",
    "SmallInitEmbedding",
    "SmallInitLinear",
    "TransformerLM",
]

#: the standard deviation of the transformer's weights (GPT-2's)
INIT_STD = 0.02


class SmallInitLinear(nn.Linear):
    """``nn.Linear`` initialized as GPT-2's: weight normal(0, 0.02), bias zero. The values are drawn in
    ``reset_parameters()`` (called by the constructor), so a model built on the meta device and
    initialized module by module in registration order gets the plain build's values bit for bit."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class SmallInitEmbedding(nn.Embedding):
    """``nn.Embedding`` initialized normal(0, 0.02) in ``reset_parameters()`` (as
    :class:`SmallInitLinear`)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = SmallInitLinear(d_model, 3 * d_model)
        self.proj = SmallInitLinear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sizes come from the projection's output and n_heads, so tensor parallelism (local heads, a
        # sequence gathered inside qkv) runs this forward unchanged
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return cast(torch.Tensor, self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class Block(nn.Module):
    """Pre-norm transformer block; the unit FSDP wraps."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            SmallInitLinear(d_model, 4 * d_model), nn.GELU(), SmallInitLinear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return cast(torch.Tensor, x + self.drop(self.mlp(self.ln2(x))))


class TransformerLM(nn.Module):
    """Byte-level (vocabulary 256) causal language model; returns logits ``(B, T, 256)``. ``vocab``
    and ``tie_embeddings`` (the head's weight is the token embedding's) shape other transformers
    alike (``dtlab advise`` lays out the models it prices from this class).

    Every layer draws its values in its own ``reset_parameters()`` as it is constructed (linear and
    embedding weights normal(0, 0.02), biases zero, norms ones and zeros), so building it on the meta
    device and letting a strategy initialize it (``init_seed``) gives the plain build's values."""

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        dropout: float = 0.0,
        *,
        vocab: int = 256,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = SmallInitEmbedding(vocab, d_model)
        self.pos = SmallInitEmbedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = SmallInitLinear(d_model, vocab, bias=False)
        if tie_embeddings:  # one weight: the head reads the token embedding (GPT-2's habit)
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = _embed(self.tok, self.pos, self.seq_len, idx)
        for block in self.blocks:
            x = block(x)
        return cast(torch.Tensor, self.head(self.ln_f(x)))

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, object]:
        """How tensor parallelism splits this model (Megatron's layout): attention heads and the MLP
        split, the token embedding vocabulary-parallel, the head column-parallel (vocabulary-split
        logits for ``vocab_parallel_cross_entropy``, never gathered); with ``sequence_parallel`` the
        norms and position embedding work on a chunk of the sequence."""
        sp = bool(sequence_parallel)
        plan: dict[str, object] = {
            "tok": VocabParallel(sequence_parallel=sp),
            "blocks.*.attn": HeadsParallel(sequence_parallel=sp),
            "blocks.*.mlp.0": ColwiseParallel(sequence_parallel=sp),
            "blocks.*.mlp.2": RowwiseParallel(sequence_parallel=sp),
            "head": ColwiseParallel(sequence_parallel=sp),
        }
        if sp:
            plan["pos"] = SequenceParallel(split_output=True)
            for norm in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
                plan[norm] = SequenceParallel()
        return plan

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence for pipeline parallelism: token + position embedding, each block,
        final norm with the head (``PipelineParallelModel`` cuts stages between them)."""
        blocks = [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]
        return [("embed", _Embed(self)), *blocks, ("head", nn.Sequential(self.ln_f, self.head))]


class _Embed(nn.Module):
    """``TransformerLM``'s embedding as a pipeline block (shares the model's ``tok`` and ``pos``)."""

    def __init__(self, lm: TransformerLM) -> None:
        super().__init__()
        self.tok, self.pos, self.seq_len = lm.tok, lm.pos, lm.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _embed(self.tok, self.pos, self.seq_len, idx)


def _embed(tok: nn.Embedding, pos: nn.Embedding, seq_len: int, idx: torch.Tensor) -> torch.Tensor:
    t = idx.shape[1]
    if t > seq_len:
        raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={seq_len}")
    return cast(torch.Tensor, tok(idx) + pos(torch.arange(t, device=idx.device)))


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 grey digits (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.classifier(self.features(x)))
