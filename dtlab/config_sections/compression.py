"""The ``compression`` section: gradient compression (the sparse all-reduces and the compressors)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtlab.config_sections.base import Section
from dtlab.config_sections.spellings import accept_old_names

#: ``compression.algorithm`` values of the Ok-Topk paper's sparse all-reduces (and ``none``)
COMPRESSORS = ("none", "dense", "topka", "topkdsa", "gtopk", "gaussiank", "oktopk")


class CompressionConfig(Section):
    #: ``none`` (uncompressed); a sparse all-reduce of the Ok-Topk paper (``dense`` is its baseline
    #: through the compressed path); or a compressor: ``randomk``, ``qsgd``, ``powersgd``, ``fp16``, ``bf16``
    algorithm: Literal[
        "none",
        "dense",
        "topka",
        "topkdsa",
        "gtopk",
        "gaussiank",
        "oktopk",
        "randomk",
        "qsgd",
        "powersgd",
        "fp16",
        "bf16",
    ] = "none"
    #: fraction of gradient values each step sends, in (0, 1] (the sparse algorithms and random-k)
    density: float = 0.01
    #: Ok-Topk: re-evaluate the local and global thresholds every ``tau`` steps
    tau: int = Field(default=32, ge=1)
    #: Ok-Topk: rebalance the region boundaries every ``tau_prime`` steps
    tau_prime: int = Field(default=64, ge=1)
    #: dense steps before compression starts (formerly ``compression.warmup_steps``; not the LR warm-up
    #: ``optimizer.warmup_steps``). Short for short runs: the Python classes default to 128 for
    #: ``OkTopk`` (the paper's) and 10 for ``PowerSGD``, 0 for the others
    dense_warmup_steps: int = Field(default=10, ge=0)
    #: sparse algorithms and random-k: after the warm-up, steps over which the density falls from 25%
    #: to ``density`` in 4x stages (Deep Gradient Compression's warm-up training); 0: none
    ramp_steps: int = Field(default=0, ge=0)
    #: DGC momentum correction: ``optimizer.momentum`` is applied in the compressed reducer (before
    #: selection, with momentum factor masking) instead of by the optimizer; needs ``optimizer.name=sgd``
    momentum_correction: bool = False
    #: PowerSGD: rank of the low-rank approximation (``PowerSGD(rank=)``; formerly ``compression.rank``,
    #: which read like a process rank)
    powersgd_rank: int = Field(default=4, ge=1)
    #: QSGD: quantization levels per sign (int8 codes: at most 127)
    levels: int = Field(default=127, ge=1, le=127)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        return accept_old_names("compression", values)

    @field_validator("density")
    @classmethod
    def _density(cls, v: float) -> float:
        if math.isnan(v) or not 0.0 < v <= 1.0:
            raise ValueError("allowed range is (0, 1], e.g. 0.01 sends 1% of the gradient values")
        return v
