"""Tiny Hugging Face models built from configs in memory (no network, no weights) and what the tests on
them share: token batches, the language-model loss on a model's output, plain single-process steps,
``save_pretrained`` in one file and sharded, relative errors. ``transformers`` is imported when a model
is built (a test that needs it is skipped without it; the others in its file still run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from steps import plain_steps
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.trainers.tasks import logits_of

VOCAB, SEQ = 32, 8

#: tensor parallelism in Hugging Face's style names (LlamaConfig.base_model_tp_plan's, the embedding
#: and the head as transformers adds them)
LLAMA_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def transformers_module() -> Any:
    return pytest.importorskip("transformers")


def llama(
    hidden: int = 16, intermediate: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 2, **extra: Any
) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` (``VOCAB`` tokens, ``SEQ`` positions); ``extra``: more config fields."""
    transformers = transformers_module()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ, **extra,
    )  # fmt: skip
    net: nn.Module = transformers.LlamaForCausalLM(config)
    return net


def llama_gqa() -> nn.Module:
    """One layer, 4 query heads, 2 key/value heads: tp=4 would split a key/value head."""
    return llama(hidden=32, intermediate=32, layers=1, heads=4, kv_heads=2)


def gpt2(embd: int = 16, layers: int = 2, heads: int = 2, **extra: Any) -> nn.Module:
    """A tiny ``GPT2LMHeadModel`` (its head tied to the token embedding), no dropout."""
    transformers = transformers_module()
    fields: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 0, **extra}
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=embd, n_layer=layers, n_head=heads, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **fields,
    )  # fmt: skip
    net: nn.Module = transformers.GPT2LMHeadModel(config)
    return net


def gpt2_wrapped_on_meta(wrap: str, backend: CommunicationBackend, init_seed: int, **gpt2_args: Any) -> Any:
    """:func:`gpt2` built on the meta device and wrapped as ``wrap`` (``"zero3"``, ``"tp2"`` or ``"pp2"``,
    split at ``transformer.h.1``), materialized by the wrapper with ``init_seed``."""
    from dtlab.models import PipelineParallelModel, TensorParallelModel, ZeRO3Model, gpt2_plan

    with torch.device("meta"):
        net = gpt2(**gpt2_args)
    if wrap == "zero3":
        return ZeRO3Model(net, backend, persistence_threshold=0, init_seed=init_seed)
    if wrap == "tp2":
        return TensorParallelModel(net, backend, plan=gpt2_plan(), init_seed=init_seed)
    return PipelineParallelModel(net, backend, split_points=["transformer.h.1"], init_seed=init_seed)


def decoder_layer(name: str) -> type[nn.Module]:
    """The decoder layer class of ``"llama"`` or ``"gpt2"`` (an FSDP unit)."""
    transformers = transformers_module()
    layer: type[nn.Module] = (
        transformers.models.llama.modeling_llama.LlamaDecoderLayer
        if name == "llama"
        else transformers.models.gpt2.modeling_gpt2.GPT2Block
    )
    return layer


def tokens() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """64 next-token pairs of ``SEQ`` tokens (a ``data.factory``)."""
    seqs = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [(s[:-1], s[1:]) for s in seqs]


def token_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of ``SEQ`` tokens and their next tokens, drawn from their own generator."""
    seqs = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return seqs[:, :-1], seqs[:, 1:]


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every position of a model output's logits, in the logits' dtype."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_steps(
    model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int, loss_fn: Any = lm_loss
) -> list[float]:
    """``steps`` plain steps (forward, backward, step, zero_grad) on one batch; the losses."""
    return plain_steps(model, opt, [(x, y)] * steps, loss_fn)


def save_one_and_sharded(net: Any, root: Path, name: str) -> None:
    """``save_pretrained`` into ``root/name-one`` (one file) and ``root/name-sharded`` (an index)."""
    net.save_pretrained(root / f"{name}-one")
    net.save_pretrained(root / f"{name}-sharded", max_shard_size="4KB")
    assert (root / f"{name}-sharded" / "model.safetensors.index.json").is_file()


def worst_loss_error(got: list[float], want: list[float]) -> float:
    """Largest relative difference of two loss curves."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of ``got`` against ``want`` (norm of the difference over ``want``'s)."""
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def family(name: str, **extra: Any) -> nn.Module:
    """A tiny causal language model of another family (``VOCAB`` tokens, ``SEQ`` positions, 2 layers,
    hidden 32, 4 heads; 2 key/value heads where the family has grouped-query attention), no dropout:
    ``"qwen2"`` (q, k and v with biases), ``"phi3"`` (fused ``qkv_proj`` and ``gate_up_proj``),
    ``"neox"`` (GPT-NeoX: a fused ``query_key_value`` laid out head by head, partial rotary),
    ``"gemma"`` (its head tied to a scaled embedding), ``"qwen3"`` (a norm per head on q and k),
    ``"cohere"`` (``use_qk_norm=True``: a LayerNorm table per head), ``"stablelm"`` (``qk_layernorm=True``:
    a LayerNorm per head), ``"bert"`` (a masked-LM encoder),
    ``"bart"`` (an encoder-decoder; its decoder reads the input ids shifted right) or ``"t5"`` (an
    encoder-decoder with a position bias per head)."""
    transformers = transformers_module()
    sizes: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": SEQ, "use_cache": False,
    }  # fmt: skip
    if name == "bert":
        fields = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **extra}
        net: nn.Module = transformers.BertForMaskedLM(transformers.BertConfig(**sizes, **fields))
        return net
    if name == "bart":
        config = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, **extra,
        )  # fmt: skip
        net = transformers.BartForConditionalGeneration(config)
        return net
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, use_cache=False, **extra,
        )  # fmt: skip
        net = transformers.T5ForConditionalGeneration(config)
        return net
    if name == "neox":
        config = transformers.GPTNeoXConfig(**sizes, rotary_pct=0.5, hidden_dropout=0.0, **extra)
        net = transformers.GPTNeoXForCausalLM(config)
        return net
    sizes["num_key_value_heads"] = 2
    if name == "phi3":
        fields = {"pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 0, "resid_pdrop": 0.0, **extra}
        net = transformers.Phi3ForCausalLM(transformers.Phi3Config(**sizes, **fields))
        return net
    kinds = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "cohere": ("CohereConfig", "CohereForCausalLM"),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    }  # fmt: skip
    config_class, model_class = kinds[name]
    if name in ("gemma", "qwen3"):
        sizes["head_dim"] = 8  # their defaults are 256 and 128
    net = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes, **extra))
    return net
