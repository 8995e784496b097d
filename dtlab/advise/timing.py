"""Step time: compute from a FLOP count, communication from an alpha-beta model per mesh axis, and
the pipeline bubble.

- compute: ``tokens * flops_per_token * (3, or 4 with activation checkpointing) / (ranks * rate)``,
  stretched by the pipeline bubble: ``/ (1 - bubble)``;
- communication on an axis of ``P`` ranks: ``sum over calls of steps * alpha + bytes_sent / beta``,
  where a ring all-reduce takes ``2 (P-1)`` steps, a reduce-scatter or all-gather ``P-1``, a
  point-to-point message 1; ``alpha``/``beta`` are the latency and bandwidth inside a node when the
  axis's groups fit in one (the mesh is row-major, tp fastest: a tp group spans ``tp`` consecutive
  ranks, a dp group ``dp * tp``, a pipeline all ``pp * dp * tp``), between nodes otherwise;
- nothing overlaps: step = compute + the sum of every axis's communication (an upper bound; the
  strategies overlap dp reductions with the backward on real engines).
"""

from __future__ import annotations

from dtlab.advise.spec import ClusterSpec

__all__ = ["AXIS_EXTENT", "bubble", "comm_seconds", "inside_node", "ring_steps"]

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


def bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: ``(p-1)/(m+p-1)`` (GPipe, 1F1B), ``(p-1)/(v m+p-1)``
    (interleaved 1F1B), ``(p-1)/(3 m+p-1)`` (ZB-H1, for ``m >= p`` and F = I = W)."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
