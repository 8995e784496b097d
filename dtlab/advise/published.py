"""Four published large training runs, as ``dtlab advise`` describes them: the check of its model.

Each run: the model's shape (tied embeddings where the model ties them; attention as those
frameworks ran it in 2021-22, keeping the ``s x s`` softmax), the cluster, the authors' plan, the
precision policy their framework ran, and the throughput the paper reports (TFLOP/s per GPU,
counted with Megatron-LM's formula ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per step, which
includes the recomputed forward: Narayanan et al. 2021, eq. 3). The published step time is that
count over the GPUs' throughput.
Sources and the comparison: docs/strategies.md, "Checked against published runs"
(``python -m dtlab.benchmarks.advise_published`` prints it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dtlab.advise.plan import parse_plan
from dtlab.advise.precision import Precision
from dtlab.advise.predict import Memo, Prediction, predict
from dtlab.advise.spec import Candidate, ClusterSpec, ModelSpec
from dtlab.errors import ArgumentError

__all__ = ["PUBLISHED", "PublishedRun", "fit_rate", "megatron_flops"]

#: Megatron-LM / DeepSpeed bf16 (or fp16): 2-byte parameters and gradients in compute, fp32 gradient
#: accumulation, an fp32 master copy and fp32 Adam states: 2 + 4 + 4 + 8 = 18 bytes per parameter
_MEGATRON_BF16 = Precision.named("bf16-mixed").custom(name="megatron-bf16", params=2, compute=2, master=4)
#: DeepSpeed fp16 (GPT-NeoX): fp16 parameters and gradients (reduced in fp16), fp32 master and Adam
_DEEPSPEED_FP16 = Precision.named("fp16-mixed").custom(
    name="deepspeed-fp16", params=2, compute=2, grads=2, master=4, reduce=2
)
#: metaseq's FSDP with memory-efficient fp16 (OPT): fp16 parameters and gradients, fp32 master and
#: Adam states, all sharded
_METASEQ_FP16 = _DEEPSPEED_FP16.custom(name="metaseq-fp16")


def megatron_flops(spec: ModelSpec, global_batch: int) -> float:
    """FLOPs per step as Megatron-LM counts them (with the recomputed forward)."""
    b, s, n, h, v = global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


@dataclass(frozen=True)
class PublishedRun:
    name: str
    spec: ModelSpec
    #: the cluster (its ``tflops`` is replaced by the fitted rate)
    cluster: ClusterSpec
    global_batch: int
    #: the authors' plan, in ``--plan`` syntax
    plan: str
    precision: Precision
    #: TFLOP/s per GPU the paper reports
    tflops: float
    source: str
    #: what the paper says (or what we assumed where it says nothing)
    setup: str

    @property
    def published_seconds(self) -> float:
        return megatron_flops(self.spec, self.global_batch) / (self.cluster.ranks * self.tflops * 1e12)

    def candidate(self) -> Candidate:
        return parse_plan(self.plan, self.cluster.ranks, self.global_batch)

    def predict(
        self, tflops: float, candidate: Candidate | None = None, memo: Memo | None = None
    ) -> Prediction:
        c = candidate or self.candidate()
        cluster = replace(self.cluster, tflops=tflops)
        return predict(self.spec, cluster, c, self.global_batch, precision=self.precision, memo=memo)


def _a100(ranks: int, memory_gib: float, inter_node_gbps: float) -> ClusterSpec:
    """A100s, 8 per node on NVLink (300 GB/s each way); ``inter_node_gbps``: each GPU's share of its
    node's links to the others."""
    return ClusterSpec(
        ranks=ranks,
        memory_gib=memory_gib,
        bandwidth_gbps=2400.0,
        latency_us=5.0,
        inter_node_bandwidth_gbps=inter_node_gbps,
        inter_node_latency_us=10.0,
        ranks_per_node=8,
    )


PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(
        "BLOOM-176B",
        ModelSpec(70, 14336, 112, 250880, 2048, "BLOOM-176B", True, False),
        _a100(384, 80, 50.0),
        2048,
        "dp=8,tp=4,pp=12,strategy=zero1,schedule=1f1b,micro_batch=2,checkpointing=full",
        _MEGATRON_BF16,
        150.0,
        "BigScience, BLOOM (arXiv:2211.05100), sec. 3.4; bigscience.notion.site 'BigScience 176B Model'",
        "384 A100 80GB (48 nodes, 4 x 100 Gbit/s Omni-Path each), Megatron-DeepSpeed, bf16 with fp32 "
        "master weights, ZeRO-1, global batch 2048 x 2048 tokens, micro-batch 2, activation "
        "checkpointing, ~150 TFLOP/s per GPU, 'one copy of the model takes 48 GPUs (60 GB each)'",
    ),
    PublishedRun(
        "OPT-175B",
        ModelSpec(96, 12288, 96, 50272, 2048, "OPT-175B", True, False),
        _a100(992, 80, 200.0),
        992,
        "dp=124,tp=8,strategy=fsdp,micro_batch=8,checkpointing=full",
        _METASEQ_FP16,
        147.0,
        "Zhang et al., OPT (arXiv:2205.01068), sec. 2.4",
        "992 A100 80GB, FSDP with Megatron-LM tensor parallelism (8), fp16 weights with fp32 Adam "
        "state sharded, ~2M tokens per batch (992 sequences: 8 per data-parallel rank, assumed), "
        "activation checkpointing (assumed), up to 147 TFLOP/s per GPU",
    ),
    PublishedRun(
        "GPT-NeoX-20B",
        ModelSpec(44, 6144, 64, 50432, 2048, "GPT-NeoX-20B", False, False),
        _a100(96, 40, 100.0),
        1536,
        "dp=12,tp=2,pp=4,strategy=zero1,schedule=1f1b,micro_batch=4,checkpointing=full",
        _DEEPSPEED_FP16,
        117.0,
        "Black et al., GPT-NeoX-20B (arXiv:2204.06745), sec. 3.1 and 3.2",
        "96 A100 40GB (12 nodes, 4 x 200 Gbit/s HDR each), tensor 2 x pipeline 4 x data 12, ZeRO-1, "
        "fp16, ~3.15M tokens per batch (1536 sequences: micro-batch 4, 32 accumulated, as the "
        "released config), activation checkpointing, 117 TFLOP/s per GPU",
    ),
    PublishedRun(
        "MT-NLG 530B",
        ModelSpec(105, 20480, 128, 51200, 2048, "MT-NLG-530B", True, False),
        _a100(2240, 80, 200.0),
        1920,
        "dp=8,tp=8,pp=35,strategy=zero1,schedule=1f1b,micro_batch=1,checkpointing=full",
        _MEGATRON_BF16,
        126.0,
        "Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
        "(arXiv:2201.11990), sec. 2.4",
        "2240 A100 80GB (280 DGX A100, 8 x 200 Gbit/s HDR each), tensor 8 x pipeline 35 x data 8, bf16, "
        "global batch 1920 x 2048 tokens, micro-batch 1, activation checkpointing; 60.1 s per "
        "iteration, 126 TFLOP/s per GPU (ZeRO-1 assumed for the data-parallel axis)",
    ),
)


def fit_rate(runs: Sequence[PublishedRun] = PUBLISHED, memos: Sequence[Memo] | None = None) -> float:
    """The one FLOP rate (TFLOP/s) at which the authors' plans' predicted step times best match the
    published ones: least squares of the log ratio (golden-section search on the log rate).
    ``memos``: one :class:`~dtlab.advise.predict.Memo` per run, filled here for the run's later
    predictions and searches (the model's layout built once per run)."""

    memos = list(memos) if memos is not None else [Memo() for _ in runs]  # the stages, the state split
    if len(memos) != len(runs):
        raise ArgumentError(f"fit_rate: {len(memos)} memos for {len(runs)} runs; give one per run")

    def loss(log_rate: float) -> float:
        rate = math.exp(log_rate)
        return sum(
            math.log(r.predict(rate, memo=m).step_seconds / r.published_seconds) ** 2
            for r, m in zip(runs, memos, strict=True)
        )

    lo, hi = math.log(50.0), math.log(1000.0)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(25):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)
