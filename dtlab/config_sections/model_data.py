"""The ``model`` and ``data`` sections: what is trained on what (built-in or your own factories)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dtlab.config_sections.base import Section, check_reference


class ModelConfig(Section):
    #: ``transformer_lm``: byte-level causal transformer; ``digits_cnn``: small CNN for 8x8 digits
    name: Literal["transformer_lm", "digits_cnn"] = "transformer_lm"
    #: your own model: ``package.module:function`` called with no arguments, returning an ``nn.Module``
    #: (replaces ``model.name``)
    factory: str | None = None
    #: ``cross_entropy``, ``mse`` or ``package.module:function`` of ``(output, target)`` returning a
    #: scalar; ``None``: the built-in task's loss (cross entropy)
    loss: str | None = None
    #: transformer width (embedding and residual stream)
    d_model: int = Field(default=128, ge=8)
    #: transformer blocks
    n_layers: int = Field(default=2, ge=1)
    #: attention heads per block (must divide ``d_model``)
    n_heads: int = Field(default=4, ge=1)
    #: tokens per sample (the built-in model's position table has one row per token)
    seq_len: int = Field(default=64, ge=2, le=1 << 20)
    #: dropout probability in the blocks
    dropout: float = Field(default=0.0, ge=0, lt=1)
    #: how the model is built (default ``None``: ``meta`` where the strategy shards the model, ``plain``
    #: where every rank holds it whole: DDP, ZeRO-1/2); ``meta``: on the meta device (shapes only), each
    #: rank materializing and initializing only its own part, one module whole at a time (ZeRO-3, FSDP,
    #: tensor, pipeline and hybrid parallelism); ``plain``: whole on every rank, then wrapped
    init: Literal["meta", "plain"] | None = None
    #: pretrained weights loaded after the model is built (before a resume, which replaces them): a
    #: safetensors file, a folder with ``model.safetensors`` or a sharded ``model.safetensors.index.json``
    #: (what Hugging Face's ``save_pretrained`` writes), or the file ``dtlab consolidate`` writes; keys
    #: are the module's ``state_dict()`` keys, all must match; each rank reads only its part
    pretrained: str | None = None

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        return check_reference(v, "model.factory")

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str | None) -> str | None:
        return v if v in (None, "cross_entropy", "mse") else check_reference(v, "model.loss")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "pick model.n_heads dividing model.d_model"
            )
        return self


class DataConfig(Section):
    #: ``stdlib``: the Python standard library's own source files; ``digits``: scikit-learn's digits
    dataset: Literal["stdlib", "digits"] = "stdlib"
    #: your own data: ``package.module:function`` called with no arguments, returning a map-style torch
    #: ``Dataset`` of ``(input, target)`` pairs (the last ``eval_fraction`` is held out) or a
    #: ``(train, eval)`` pair of them (replaces ``data.dataset``)
    factory: str | None = None
    #: ``DataLoader`` worker processes per rank (0: load in the training thread)
    num_workers: int = Field(default=0, ge=0)
    #: ``DataLoader(pin_memory=...)``: page-locked host batches for faster copies to a GPU
    pin_memory: bool = False
    #: bytes of the stdlib corpus to read (a deterministic subset of files, sorted by path)
    max_bytes: int = Field(default=1_000_000, ge=10_000)
    #: samples per optimizer step over all data-parallel ranks (ranks x accumulation steps x micro-batch)
    global_batch_size: int = Field(default=32, ge=1)
    #: micro-batches per rank and step; gradients travel once, after the last
    accumulation_steps: int = Field(default=1, ge=1)
    #: fraction of the data held out for evaluation
    eval_fraction: float = Field(default=0.05, gt=0, lt=1)
    #: shuffle the training samples each epoch (seeded by ``train.seed``)
    shuffle: bool = True

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        return check_reference(v, "data.factory")
