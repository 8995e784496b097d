"""The Hugging Face ``LlamaForCausalLM`` the benchmarks build from a config (no weights downloaded),
its token batch and its loss; the sizes come from a dict of the benchmark's arguments."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    import torch
    import transformers

#: the argument names :func:`add_llama_args` adds (``--kv-heads`` as ``kv_heads``)
LLAMA_KEYS = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "batch", "seq")


def add_llama_args(parser: argparse.ArgumentParser, layers: int) -> None:
    """The model's and the batch's sizes, defaults those of the published measurements."""
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)


def llama_config(args: dict[str, Any], **extra: Any) -> transformers.LlamaConfig:
    """A ``LlamaConfig`` of ``args``' sizes (``kv_heads``: ``heads`` when absent); ``extra``: more fields."""
    import transformers

    fields = {
        "vocab_size": args["vocab"],
        "hidden_size": args["hidden"],
        "intermediate_size": args["intermediate"],
        "num_hidden_layers": args["layers"],
        "num_attention_heads": args["heads"],
        "num_key_value_heads": args.get("kv_heads", args["heads"]),
        "max_position_embeddings": args["seq"],
    }
    return transformers.LlamaConfig(**(fields | extra))


def llama(args: dict[str, Any], **extra: Any) -> transformers.LlamaForCausalLM:
    """The model, its values drawn from seed 0 (torch's global RNG forked: left as it was)."""
    import torch
    import transformers

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(llama_config(args, **extra))


def token_batch(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``args["batch"]`` sequences of ``args["seq"]`` tokens and their next tokens (seed 1)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1), generator=gen)
    return seqs[:, :-1], seqs[:, 1:]


def lm_loss(output: Any, y: torch.Tensor) -> torch.Tensor:  # output: a tensor, a model output, a tuple
    """Cross entropy of the logits (a tensor, an output's ``.logits`` or a traced stage's first output)."""
    import torch.nn.functional as F

    logits = getattr(output, "logits", output)
    if isinstance(logits, tuple | list):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
