"""What ``dtlab advise`` reasons about: the model, the cluster, the optimizer and one candidate plan.

Small frozen dataclasses, checked at construction: a bad value is one :class:`ArgumentError` naming
the field, the value and what is allowed. The formulas that use them are in docs/strategies.md,
section "Choosing a mesh: the cost model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dtlab.core import pairs
from dtlab.core.plan import TP_BATCH_CHECKS, RunPlan, TpBatchCheckWhen
from dtlab.errors import ArgumentError, integer, real

__all__ = [
    "CHECKPOINTING",
    "DP_STRATEGIES",
    "SCHEDULES",
    "Candidate",
    "ClusterSpec",
    "ModelSpec",
    "OptimizerSpec",
    "StrategyOptions",
]

#: the data-parallel strategies a candidate chooses from (dtlab's model strategy names)
DP_STRATEGIES = pairs.DATA_PARALLEL
#: pipeline schedules, by the names of dtlab.core.pairs
SCHEDULES = pairs.SCHEDULES
#: activation checkpointing: none, per transformer block (Megatron's "full" recompute, what dtlab
#: does without a pipeline), per pipeline stage (what dtlab's pipeline does)
CHECKPOINTING = ("none", "block", "stage")
#: the vocabulary of dtlab's embedded byte-level transformer
BYTE_VOCAB = 256

DpStrategy = Literal["ddp", "zero1", "zero2", "zero3", "fsdp"]
Checkpointing = Literal["none", "block", "stage"]


def _numbers(spec: object, *names: str, whole: bool = False, zero: bool = False) -> None:
    """Refuses ``spec``'s fields ``names`` unless each is an integer >= 1 (``whole``) or a number > 0
    (>= 0 with ``zero``), and stores each as a Python number (a NumPy one converted)."""
    for name in names:
        v = getattr(spec, name)
        n = integer(v) if whole else real(v)
        if n is None or n < (1 if whole else 0) or (n == 0 and not zero):
            what = "an integer >= 1" if whole else "a number >= 0" if zero else "a number > 0"
            raise ArgumentError(f"{type(spec).__name__}.{name} must be {what}, got {v!r}")
        object.__setattr__(spec, name, n)


@dataclass(frozen=True)
class ModelSpec:
    """A causal transformer shaped like dtlab's ``TransformerLM`` (dtlab/zoo/builtin.py): token and
    position embeddings, ``layers`` pre-norm blocks (attention with a fused qkv projection, an MLP of
    ``4 * hidden``, two LayerNorms, biases everywhere), a final LayerNorm and a head, untied
    (dtlab's) or tied to the token embedding (``tied_embeddings``: one weight; under a pipeline the
    last stage holds a copy whose gradient is summed with the first stage's, as Megatron-LM does).
    ``fused_attention``: attention keeps one log-sum-exp per head and token (dtlab's, FlashAttention);
    ``False``: it keeps the ``s x s`` softmax of every head (frameworks before fused kernels)."""

    layers: int
    hidden: int
    heads: int
    vocab: int = BYTE_VOCAB
    seq_len: int = 64
    name: str = "transformer"
    tied_embeddings: bool = False
    fused_attention: bool = True

    def __post_init__(self) -> None:
        _numbers(self, "layers", "hidden", "heads", "vocab", "seq_len", whole=True)
        if self.hidden % self.heads:
            raise ArgumentError(
                f"ModelSpec: hidden={self.hidden} is not divisible by heads={self.heads}; pick heads "
                "dividing hidden"
            )

    @classmethod
    def builtin(
        cls,
        name: str = "transformer",
        *,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
    ) -> ModelSpec:
        """dtlab's embedded model (``model.name=transformer_lm``) with the config's sizes (defaults:
        those of ``dtlab train``); its vocabulary is the 256 byte values."""
        if name not in ("transformer", "transformer_lm"):
            raise ArgumentError(
                f"unknown built-in model {name!r}; the built-in one is 'transformer' (dtlab's embedded "
                "TransformerLM); describe any other transformer by its sizes"
            )
        return cls(n_layers, d_model, n_heads, BYTE_VOCAB, seq_len, "transformer")

    @classmethod
    def from_parameters(
        cls,
        parameters: int,
        *,
        layers: int,
        heads: int,
        vocab: int,
        seq_len: int,
        tied_embeddings: bool = False,
        fused_attention: bool = True,
    ) -> ModelSpec:
        """The transformer of ``layers`` blocks whose parameter count is nearest ``parameters``: the
        hidden size solves ``12 L h^2 + ((2 or 1) V + s + 13 L + 2) h = N``, rounded to a multiple of
        ``heads``."""
        for name, v in (("parameters", parameters), ("layers", layers), ("heads", heads)):
            if integer(v) is None or v < 1:
                raise ArgumentError(f"ModelSpec.{name} must be an integer >= 1, got {v!r}")
        parameters, layers, heads = int(parameters), int(layers), int(heads)
        a, b = 12 * layers, (1 if tied_embeddings else 2) * vocab + seq_len + 13 * layers + 2
        root = (-b + math.sqrt(b * b + 4 * a * parameters)) / (2 * a)
        hidden = max(heads, heads * round(root / heads))
        name = f"transformer~{parameters:.3g}"
        return cls(layers, hidden, heads, vocab, seq_len, name, tied_embeddings, fused_attention)

    @property
    def parameters(self) -> int:
        """Exact parameter count: ``2 V h + s h + L (12 h^2 + 13 h) + 2 h`` (tied: ``V h`` less)."""
        h, v = self.hidden, self.vocab
        head = 0 if self.tied_embeddings else v * h
        return v * h + head + self.seq_len * h + self.layers * (12 * h * h + 13 * h) + 2 * h

    def flops_per_token(self) -> float:
        """Forward FLOPs per token: ``2 (12 L h^2 + V h)`` for the matrix products plus ``4 L s h`` for
        attention scores and their weighted sum (PaLM's convention: the full square, not half)."""
        h = self.hidden
        return 2.0 * (12 * self.layers * h * h + self.vocab * h) + 4.0 * self.layers * self.seq_len * h


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links. Bandwidths in Gbit/s (as links are quoted; between nodes, each device's
    share), latencies in microseconds, memory in GiB, compute in TFLOP/s one device reaches on large
    matrix products (a fitted rate, not the datasheet peak). ``gemm_knee``: the matrix dimension at
    which a product runs at half that rate; a product of ``M x K`` by ``K x N`` runs at
    ``M/(M+k) * N/(N+k) * K/(K+k)`` of it (docs/strategies.md, "The formulas")."""

    ranks: int
    memory_gib: float = 80.0
    tflops: float = 100.0
    bandwidth_gbps: float = 2400.0
    latency_us: float = 5.0
    inter_node_bandwidth_gbps: float = 200.0
    inter_node_latency_us: float = 10.0
    ranks_per_node: int = 8
    gemm_knee: float = 64.0

    def __post_init__(self) -> None:
        _numbers(self, "ranks", "ranks_per_node", whole=True)
        _numbers(self, "memory_gib", "tflops", "bandwidth_gbps", "inter_node_bandwidth_gbps")
        _numbers(self, "latency_us", "inter_node_latency_us", "gemm_knee", zero=True)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


@dataclass(frozen=True)
class OptimizerSpec:
    """The torch optimizer the strategies drive: its state per parameter element and per tensor.

    ``adam``/``adamw``: two moments per element plus ``step``, a 4-byte tensor per optimized tensor;
    ``sgd``: a momentum buffer per element when ``momentum > 0``, nothing otherwise."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "adam", "sgd"):
            raise ArgumentError(f"OptimizerSpec.name must be 'adamw', 'adam' or 'sgd', got {self.name!r}")

    @property
    def states_per_element(self) -> int:
        if self.name in ("adam", "adamw"):
            return 2
        return 1 if self.momentum > 0 else 0

    @property
    def bytes_per_tensor(self) -> int:
        return 4 if self.name in ("adam", "adamw") else 0


@dataclass(frozen=True)
class StrategyOptions:
    """The strategy settings of ``dtlab train`` (``strategy.*`` in the config, same defaults)."""

    bucket_cap_mb: float = 25.0
    persistence_threshold: int = 0
    reshard_after_forward: bool | None = None
    prefetch: bool = True
    gradient_sync: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    #: ``parallel.tp_batch_check``: "always" counts the check's all-reduce in every step; "first" and
    #: "never" none (the steady step: "first" checks only the first steps)
    tp_batch_check: TpBatchCheckWhen = "always"
    #: ``strategy.find_unused_parameters``: each synchronization all-reduces which parameters every rank
    #: used (ZeRO-3/FSDP also compare the units each rank gathered), and a pipeline skips its check of
    #: every replica's unused-parameter counts over dp
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        _numbers(self, "bucket_cap_mb")
        if self.tp_batch_check not in TP_BATCH_CHECKS:
            raise ArgumentError(
                f"StrategyOptions.tp_batch_check must be one of {', '.join(map(repr, TP_BATCH_CHECKS))}, "
                f"got {self.tp_batch_check!r}"
            )
        if self.gradient_sync not in ("reduce_scatter", "all_reduce"):
            raise ArgumentError(
                "StrategyOptions.gradient_sync must be 'reduce_scatter' or 'all_reduce', got "
                f"{self.gradient_sync!r}"
            )
        if not isinstance(self.find_unused_parameters, bool):
            raise ArgumentError(
                "StrategyOptions.find_unused_parameters must be True or False, got "
                f"{self.find_unused_parameters!r}"
            )


@dataclass(frozen=True)
class Candidate:
    """One plan: the data-parallel strategy over ``dp`` ranks, tensor parallelism over ``tp``, a
    pipeline of ``pp`` ranks running ``schedule`` over ``micro_batches`` (``stages_per_rank`` chunks per
    rank for the interleaved schedule); without a pipeline, ``micro_batches`` is gradient
    accumulation (``schedule="none"``). ``checkpointing``: ``"none"``, ``"block"`` (each transformer
    block keeps its input and is recomputed in the backward) or ``"stage"`` (each pipeline stage);
    ``True``/``False`` mean ``"block"``/``"none"``."""

    strategy: DpStrategy
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "none"
    micro_batches: int = 1
    stages_per_rank: int = 1
    checkpointing: Checkpointing = "none"

    def __post_init__(self) -> None:
        ckpt: object = self.checkpointing
        if ckpt is True or ckpt is False:
            object.__setattr__(self, "checkpointing", "block" if ckpt else "none")
        elif ckpt not in CHECKPOINTING:
            raise ArgumentError(
                f"Candidate.checkpointing must be one of {', '.join(CHECKPOINTING)}, got {ckpt!r}"
            )
        if self.strategy not in DP_STRATEGIES:
            raise ArgumentError(
                f"Candidate.strategy must be one of {', '.join(DP_STRATEGIES)}, got {self.strategy!r}"
            )
        _numbers(self, "dp", "tp", "pp", "micro_batches", "stages_per_rank", whole=True)
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise ArgumentError(
                f"Candidate with pp={self.pp} needs a schedule in {', '.join(SCHEDULES)}, got "
                f"{self.schedule!r}"
            )
        if self.pp == 1 and (self.schedule != "none" or self.stages_per_rank != 1):
            raise ArgumentError(
                "Candidate without a pipeline (pp=1) takes schedule='none' and stages_per_rank=1, got "
                f"schedule={self.schedule!r}, stages_per_rank={self.stages_per_rank}"
            )
        if self.stages_per_rank > 1 and self.schedule != "interleaved_1f1b":
            raise ArgumentError(
                f"Candidate: stages_per_rank={self.stages_per_rank} needs schedule='interleaved_1f1b', "
                f"got {self.schedule!r}"
            )
        if self.checkpointing == "stage" and self.pp == 1:
            raise ArgumentError(
                "Candidate: checkpointing='stage' needs a pipeline (pp > 1); use 'block' without one"
            )

    @classmethod
    def from_plan(
        cls, plan: RunPlan, accumulation_steps: int = 1, checkpointing: Checkpointing | None = None
    ) -> Candidate:
        """The candidate a resolved run plan describes (the config's, ``--plan``'s): its sizes,
        strategy, schedule and micro-batches (without a pipeline: ``accumulation_steps``);
        ``checkpointing`` defaults to the plan's (per stage with a pipeline, else per block)."""
        ckpt: Checkpointing = (
            ("stage" if plan.pipelined else "block") if plan.activation_checkpointing else "none"
        )
        return cls(
            plan.data_parallel,  # type: ignore[arg-type]
            dp=plan.mesh_shape["dp"],
            tp=plan.tp,
            pp=plan.pp,
            schedule=plan.schedule if plan.pipelined else "none",
            micro_batches=plan.micro_batch_count if plan.pipelined else accumulation_steps,
            stages_per_rank=plan.stages_per_rank,
            checkpointing=ckpt if checkpointing is None else checkpointing,
        )

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def label(self) -> str:
        parts = [self.strategy, f"dp{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            chunks = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp{self.pp} {self.schedule} m{self.micro_batches}{chunks}")
        elif self.micro_batches > 1:
            parts.append(f"accum{self.micro_batches}")
        if self.checkpointing == "block":
            parts.append("ckpt")
        elif self.checkpointing == "stage":
            parts.append("ckpt-stage")
        return " ".join(parts)

    @property
    def checkpointed(self) -> bool:
        return self.checkpointing != "none"
