"""Step time: compute per micro-batch from the matrix products' shapes, communication from an
alpha-beta model per mesh axis, the pipeline schedule, and what overlaps what.

- a matrix product ``M x K`` by ``K x N`` takes ``2 M N K / (rate * eff)`` with
  ``eff = M/(M+k) * N/(N+k) * K/(K+k)``, ``k`` the device's ``gemm_knee`` (small products run below
  the rate large ones reach); a block's forward ``F`` is its four products (qkv, attention output,
  the two MLP layers, split by tp) and attention (``4 s h / t`` FLOPs per token, head-sized products);
  its backward splits into ``I`` (input gradients: the four products again and twice the attention)
  and ``W`` (weight gradients: the four products); checkpointing adds ``F`` to ``I``;
- communication on an axis of ``P`` ranks: ``sum over calls of steps * alpha + bytes_sent / beta``,
  where a ring all-reduce takes ``2 (P-1)`` steps, a reduce-scatter or all-gather ``P-1``, a
  point-to-point message 1; ``alpha``/``beta`` are the latency and bandwidth inside a node when the
  axis's groups fit in one (the mesh is row-major, tp fastest: a tp group spans ``tp`` consecutive
  ranks, a dp group ``dp * tp``, a pipeline all ``pp * dp * tp``), between nodes otherwise;
- the schedule: ``(m + p - 1)(F + B)`` (GPipe, 1F1B), ``m (F + B) + (p - 1)(F + B) / v``
  (interleaved), ``m (F + I + W) + (p - 1)(F + I - W)`` (ZB-H1), ``m (F + B)`` without a pipeline
  (what ``simulate()`` gives on dtlab's schedules).
"""

from __future__ import annotations

from dtlab.advise.spec import ClusterSpec, ModelSpec

__all__ = [
    "AXIS_EXTENT",
    "PassTimes",
    "bubble",
    "comm_seconds",
    "gemm_seconds",
    "inside_node",
    "pass_times",
    "pipeline_seconds",
    "ring_steps",
]

#: how many consecutive ranks one group of an axis spans, from the axis sizes
AXIS_EXTENT = {"tp": ("tp",), "dp": ("dp", "tp"), "pp": ("pp", "dp", "tp")}


def ring_steps(kind: str, p: int) -> int:
    if kind == "all_reduce":
        return 2 * (p - 1)
    if kind in ("reduce_scatter", "all_gather"):
        return p - 1
    return 1


def inside_node(extent: int, cluster: ClusterSpec) -> bool:
    return extent <= cluster.ranks_per_node and cluster.ranks_per_node % extent == 0


def comm_seconds(ops: dict[str, tuple[int, int]], p: int, intra: bool, cluster: ClusterSpec) -> float:
    if p <= 1:
        return 0.0
    if intra:
        alpha, gbps = cluster.latency_us, cluster.bandwidth_gbps
    else:
        alpha, gbps = cluster.inter_node_latency_us, cluster.inter_node_bandwidth_gbps
    beta = gbps * 1e9 / 8  # bytes per second
    total = 0.0
    for kind, (calls, nbytes) in ops.items():
        if kind == "recv":
            continue  # a message's time is counted once, at its send
        total += calls * ring_steps(kind, p) * alpha * 1e-6 + nbytes / beta
    return total


def gemm_seconds(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """One matrix product ``m x k`` by ``k x n`` at the device's rate, less for small dimensions."""
    knee = cluster.gemm_knee
    eff = (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee))
    return 2.0 * m * n * k / (cluster.tflops * 1e12 * eff)


class PassTimes:
    """Seconds of one micro-batch through some stages: forward ``f``, input gradients ``i`` and weight
    gradients ``w`` (``i + w``: the backward); tensor-parallel collectives and recomputation in them."""

    __slots__ = ("f", "i", "w")

    def __init__(self, f: float = 0.0, i: float = 0.0, w: float = 0.0) -> None:
        self.f, self.i, self.w = f, i, w

    def add(self, other: PassTimes) -> None:
        self.f += other.f
        self.i += other.i
        self.w += other.w

    @property
    def total(self) -> float:
        return self.f + self.i + self.w


def pass_times(
    spec: ModelSpec, sequences: int, blocks: int, last: bool, tp: int, cluster: ClusterSpec
) -> PassTimes:
    """Compute of one micro-batch of ``sequences`` through ``blocks`` blocks (and the head if ``last``)."""
    h, s, t = spec.hidden, spec.seq_len, tp
    n = sequences * s
    products = [(n, 3 * h // t, h), (n, h, h // t), (n, 4 * h // t, h), (n, h, 4 * h // t)]
    g = blocks * sum(gemm_seconds(a, b, c, cluster) for a, b, c in products)
    # attention: per sequence and local head, q k^T (s x d by d x s) and p v (s x s by s x d)
    d = h // spec.heads
    local_heads = spec.heads // t
    a = blocks * sequences * local_heads * 2 * gemm_seconds(s, s, d, cluster)
    if last:
        g += gemm_seconds(n, spec.vocab // t, h, cluster)
    return PassTimes(g + a, g + 2 * a, g)


def pipeline_seconds(schedule: str, p: int, m: int, v: int, t: PassTimes) -> float:
    """One step of ``m`` micro-batches whose per-micro-batch times on the slowest rank are ``t``."""
    b = t.i + t.w
    if p <= 1:
        return m * (t.f + b)
    if schedule == "interleaved_1f1b":
        return m * (t.f + b) + (p - 1) * (t.f + b) / v
    if schedule == "zero_bubble":
        return m * (t.f + b) + (p - 1) * max(t.f + t.i - t.w, t.f)
    return (m + p - 1) * (t.f + b)


def bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step when F = I = W (B = 2F): ``(p-1)/(m+p-1)`` (GPipe, 1F1B),
    ``(p-1)/(v m+p-1)`` (interleaved 1F1B), ``(p-1)/(3 m+p-1)`` (ZB-H1)."""
    if p <= 1:
        return 0.0
    t = PassTimes(1.0, 1.0, 1.0)
    busy = m * t.total
    return 1.0 - busy / pipeline_seconds(schedule, p, m, v, t)
