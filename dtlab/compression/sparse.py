"""Sparse building blocks shared by the sparse all-reduce algorithms.

Entries travel as interleaved ``(int32 index, float32 value bits)`` pairs in one int32 tensor, so one
message carries both and every engine (MPI, gloo, NCCL, in-memory) moves a plain int32 buffer.
Collectives here use only the :class:`CommunicationBackend` interface: ``all_gather`` of counts,
point-to-point ``isend``/``irecv`` for the split-and-reduce and the balancing step, fixed-size
``all_gather`` and ``all_gather_v`` for the gather phases, ``all_reduce`` of small histograms.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp, Work
from dtlab.compression.base import Prefilter, SparseCompressor
from dtlab.compression.finite import FiniteCheck
from dtlab.compression.kernels import (
    gather_abs,
    indices_above,
    intersect_sorted,
    radix_histogram,
    sum_sorted_runs,
)
from dtlab.compression.state_io import Workspace

__all__ = [
    "LocalTopk",
    "all_gather_counts",
    "balanced_all_gather",
    "distributed_kth_largest",
    "exchange_p2p",
    "gather_abs",
    "indices_above",
    "Magnitudes",
    "local_topk",
    "threshold_of_sample",
    "sample_positions",
    "sampled_threshold",
    "pack",
    "intersect_sorted",
    "select_by_threshold",
    "split_and_reduce",
    "sum_duplicates",
    "unpack",
]

#: point-to-point tag of compression messages (distinct from pipeline/strategy tags)
TAG = 7301
#: peers exchanged with concurrently in the split-and-reduce (the reference code's throttle)
THROTTLE = 4
#: the global k-th largest is found by gathering candidates below this many, by radix select above
GATHER_BELOW = 1024
#: exact top-k over buffers this large first pre-filters candidates with a sampled threshold
PREFILTER_MIN = 1 << 20
#: sampled thresholds: expected number of sampled elements above the threshold, smallest sample
SAMPLE_HITS, SAMPLE_MIN = 1000, 4096
#: the exact top-k's pre-filter keeps about this many times k candidates
TOPK_OVERSAMPLE = 1.25


def pack(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Interleave int indices and float32 values into one int32 tensor of ``2 * len`` elements."""
    out = torch.empty((idx.numel(), 2), dtype=torch.int32, device=vals.device)
    out[:, 0] = idx
    out[:, 1] = vals.to(torch.float32).view(torch.int32)
    return out.view(-1)


def unpack(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: (int64 indices, float32 values)."""
    pairs = buf.view(-1, 2)
    return pairs[:, 0].to(torch.int64), pairs[:, 1].contiguous().view(torch.float32)


class Magnitudes(Workspace):
    """Per-buffer scratch of the magnitude-selecting compressors.

    ``|acc|`` of one buffer in a reused float32 buffer, for the exact top-k over the whole buffer
    (the rare case in which the sampled pre-filter falls short): selecting over a large buffer then
    allocates nothing buffer-sized (fresh allocations of hundreds of MB cost more in page faults than
    the arithmetic). Threshold selections need no magnitude buffer (:func:`indices_above` is one pass
    over ``acc``). ``pre``: the :class:`~dtlab.compression.base.Prefilter` the error-feedback pass
    fills. Keep one per buffer (its state); scratch only, so checkpoints leave it out."""

    def __init__(self) -> None:
        self._abs: torch.Tensor | None = None
        self.pre = Prefilter()

    def of(self, acc: torch.Tensor) -> torch.Tensor:
        if self._abs is None or self._abs.numel() != acc.numel() or self._abs.device != acc.device:
            self._abs = torch.empty(acc.numel(), dtype=torch.float32, device=acc.device)
        return torch.abs(acc.view(-1), out=self._abs)

    def above(self, mags: torch.Tensor, thr: float, expected: int = 0) -> torch.Tensor:
        """Sorted indices with ``mags >= thr`` (and nonzero); :func:`indices_above` of ``mags``."""
        return indices_above(mags, thr, expected)

    def request_topk(self, n: int, k: int) -> Prefilter | None:
        """The pre-filter :func:`local_topk` would run on a buffer of ``n`` elements (a sampled
        threshold keeping about ``1.25 k`` candidates), asked of the error-feedback pass instead;
        ``None`` where :func:`local_topk` does not pre-filter."""
        k = min(k, n)
        if not _prefilters(n, k):
            self.pre.request(0.0, 0)
            return None
        return self.pre.request_sampled(
            sample_positions(n, k), lambda s: threshold_of_sample(s, n, k, TOPK_OVERSAMPLE), k + k // 4
        )


class LocalTopk(SparseCompressor):
    """A compressor that starts from this rank's exact top-k (TopkA, TopkDSA, gTop-k): its candidates
    are pre-filtered in the error-feedback pass, in a :class:`Magnitudes` workspace per buffer."""

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return {"work": Magnitudes()}

    def prefilter(self, state: dict[str, Any], numel: int) -> Prefilter | None:
        """Candidates for the exact local top-k, selected in the error-feedback pass."""
        work: Magnitudes = state["work"]
        return work.request_topk(numel, self.k(numel))


def _prefilters(n: int, k: int) -> bool:
    return n >= PREFILTER_MIN and 8 * k < n


def sample_positions(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random positions (fixed seed) in ``[0, n)``: ~:data:`SAMPLE_HITS` expected among the top k."""
    size = min(n, max(SAMPLE_MIN, int(SAMPLE_HITS * n / max(k, 1))))
    return torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(n * 1_000_003 + seed))


def threshold_of_sample(sample: torch.Tensor, n: int, k: int, oversample: float = 1.0) -> float:
    """The magnitude above which about ``oversample * k`` of ``n`` magnitudes lie, estimated from
    ``sample`` (magnitudes at :func:`sample_positions`)."""
    rank = min(sample.numel(), max(1, round(oversample * k * sample.numel() / n)))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def sampled_threshold(acc: torch.Tensor, k: int, oversample: float = 1.0, seed: int = 0) -> float:
    """Estimate of the magnitude above which about ``oversample * k`` of the magnitudes of ``acc`` lie,
    from a random sample (~1000 expected hits, so the estimate is within a few percent)."""
    n = acc.numel()
    sample = gather_abs(acc, sample_positions(n, k, seed).to(acc.device))
    return threshold_of_sample(sample, n, k, oversample)


def local_topk(acc: torch.Tensor, k: int, work: Magnitudes | None = None) -> tuple[torch.Tensor, float]:
    """Sorted indices of the ``k`` largest magnitudes (zeros never selected) and the k-th magnitude.

    Exact. For large buffers a sampled threshold first keeps about ``1.25 k`` candidates and the exact
    top-k runs on those only (a full top-k over all elements when the candidates fall short of k).
    The candidates come from the error-feedback pass when it made that selection
    (:meth:`Magnitudes.request_topk`): the same threshold, the same candidates.
    """
    n = acc.numel()
    k = min(k, n)
    got = work.pre.take() if work is not None else None
    if _prefilters(n, k):
        cand = got[1] if got is not None else None
        if cand is None:
            cand = indices_above(acc, sampled_threshold(acc, k, TOPK_OVERSAMPLE), k + k // 4)
        if cand.numel() >= k:
            vals, pos = torch.topk(gather_abs(acc, cand), k, sorted=False)
            # candidates are sorted and nonzero (|x| >= a positive threshold, or |x| > 0): marking
            # the chosen positions keeps them sorted without sorting k indices
            chosen = torch.zeros(cand.numel(), dtype=torch.bool, device=cand.device)
            chosen[pos] = True
            return cand[chosen], float(vals.min())
    work = work if work is not None else Magnitudes()
    vals, idx = torch.topk(work.of(acc), k, sorted=False)
    return _drop_zeros(idx, vals)


def _drop_zeros(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, float]:
    keep = vals > 0
    if not bool(keep.all()):
        idx, vals = idx[keep], vals[keep]
    return torch.sort(idx).values, (float(vals.min()) if vals.numel() else 0.0)


def select_by_threshold(acc: torch.Tensor, thr: float) -> torch.Tensor:
    """Sorted indices with ``|acc| >= thr`` (and nonzero); for small tensors (allocates masks)."""
    mask = (acc >= thr) | (acc <= -thr) if thr > 0 else acc != 0
    return torch.nonzero(mask).view(-1)


def sum_duplicates(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique indices and the sums of their values (summed in input order: deterministic)."""
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float32, device=vals.device)
    sums.index_add_(0, inverse, vals.to(torch.float32))
    return uniq, sums


def all_gather_counts(backend: CommunicationBackend, counts: list[int]) -> torch.Tensor:
    """Every rank's vector of counts: returns a ``(P, len(counts))`` int64 matrix (row = rank)."""
    p = backend.world_size
    mine = torch.tensor(counts, dtype=torch.int64, device=backend.device)
    out = torch.empty(p * len(counts), dtype=torch.int64, device=backend.device)
    backend.all_gather(out, mine)
    return out.view(p, len(counts)).cpu()


def exchange_p2p(
    backend: CommunicationBackend, sends: list[torch.Tensor | None], recv_sizes: list[int]
) -> list[torch.Tensor | None]:
    """Send ``sends[j]`` to rank j and receive ``recv_sizes[i]`` int32 elements from rank i.

    Rounds follow the reference code: in round s a rank sends to ``rank + s`` and receives from
    ``rank - s``; at most :data:`THROTTLE` rounds are in flight. Empty messages are not sent (both
    sides know the sizes). ``sends[rank]`` is returned as the own entry.
    """
    p, me = backend.world_size, backend.rank
    received: list[torch.Tensor | None] = [None] * p
    received[me] = sends[me]
    for first in range(1, p, THROTTLE):
        works: list[Work] = []
        for s in range(first, min(first + THROTTLE, p)):
            src = (me - s) % p
            if recv_sizes[src] > 0:
                buf = torch.empty(recv_sizes[src], dtype=torch.int32, device=backend.device)
                received[src] = buf
                works.append(backend.irecv(buf, src, TAG))
        for s in range(first, min(first + THROTTLE, p)):
            dst = (me + s) % p
            msg = sends[dst]
            if msg is not None and msg.numel() > 0:
                works.append(backend.isend(msg, dst, TAG))
        for w in works:
            w.wait()
    return received


def split_and_reduce(
    backend: CommunicationBackend,
    acc: torch.Tensor,
    idx: torch.Tensor,
    bounds: list[int],
    check: FiniteCheck | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse reduce-scatter: send each selected entry to the owner of its region and sum there.

    ``idx`` are sorted global indices this rank selected; region ``j`` is ``[bounds[j], bounds[j+1])``.
    Returns the owner's reduced entries as (sorted region-local indices, float32 sums); an index
    appears when any rank sent it. ``check``: a non-finite check whose count travels with the region
    sizes (one more integer per rank) and is decided on every rank's counts before any entry moves.
    """
    p, me = backend.world_size, backend.rank
    edges = torch.tensor(bounds, dtype=torch.int64, device=idx.device)
    cuts = torch.searchsorted(idx, edges).tolist()
    sizes = [cuts[j + 1] - cuts[j] for j in range(p)]
    extra = [] if check is None else [check.bad]
    matrix = all_gather_counts(backend, sizes + extra) if p > 1 else torch.tensor([sizes + extra])
    if check is not None:
        check.decide(matrix[:, p].tolist())
    sends: list[torch.Tensor | None] = []
    for j in range(p):
        part = idx[cuts[j] : cuts[j + 1]]
        sends.append(pack(part - bounds[j], acc.index_select(0, part)))
    recv_sizes = [2 * int(matrix[i, me]) for i in range(p)]
    received = exchange_p2p(backend, sends, recv_sizes)
    pieces = [unpack(t) for t in received if t is not None and t.numel() > 0]
    if not pieces:
        empty = torch.empty(0, dtype=torch.int64, device=acc.device)
        return empty, torch.empty(0, dtype=torch.float32, device=acc.device)
    # each piece is one rank's sorted entries: merged in rank order, as sum_duplicates would sum them
    counts = [i.numel() for i, _ in pieces]
    return sum_sorted_runs(torch.cat([i for i, _ in pieces]), torch.cat([v for _, v in pieces]), counts)


def balanced_all_gather(
    backend: CommunicationBackend, idx: torch.Tensor, vals: torch.Tensor, counts: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's entries (in rank order) after balancing them to ``ceil(T/P)`` per rank.

    The concatenation of all ranks' entries (``T`` in all) is cut into ``P`` equal blocks; each rank
    first sends the parts of its entries that fall into other ranks' blocks (point-to-point), then a
    fixed-size ``all_gather`` of the equal blocks completes the exchange, so no rank's share of the
    gather exceeds ``ceil(T/P)`` entries however unevenly the selection fell on the regions.
    With two ranks one point-to-point exchange of each rank's own entries does the same in one round
    instead of two: balancing would send the fuller rank's excess over ``ceil(T/2)`` to the other,
    which sends it back in its block, so each rank sends at most what it would have sent (its own
    entries; the fuller one exactly as many, the other without the excess and the padding).
    ``counts``: every rank's number of entries when already known (saves the count exchange).
    """
    p, me = backend.world_size, backend.rank
    if counts is None:
        counts = all_gather_counts(backend, [idx.numel()]).view(-1).tolist() if p > 1 else [idx.numel()]
    total = sum(counts)
    if total == 0:
        return idx[:0], vals[:0]
    if p == 1:
        return idx, vals
    if p == 2:
        mine, sizes = pack(idx, vals), [0, 0]
        sizes[1 - me] = 2 * counts[1 - me]
        got = exchange_p2p(backend, [mine, mine], sizes)  # in rank order: [rank 0's, rank 1's]
        return unpack(torch.cat([t for t in got if t is not None]))
    block = -(-total // p)
    starts = [sum(counts[:r]) for r in range(p)]
    mine = pack(idx, vals)
    sends: list[torch.Tensor | None] = []
    recv_sizes: list[int] = []
    my_lo, my_hi = min(me * block, total), min((me + 1) * block, total)
    for q in range(p):
        lo, hi = max(starts[me], q * block), min(starts[me] + counts[me], (q + 1) * block)
        sends.append(mine[2 * (lo - starts[me]) : 2 * (hi - starts[me])] if hi > lo else None)
        rlo, rhi = max(starts[q], my_lo), min(starts[q] + counts[q], my_hi)
        recv_sizes.append(2 * max(0, rhi - rlo))
    received = exchange_p2p(backend, sends, recv_sizes)
    block_buf = torch.zeros(2 * block, dtype=torch.int32, device=vals.device)
    filled = [t for t in received if t is not None]
    if filled:
        cat = torch.cat(filled)
        block_buf[: cat.numel()] = cat
    out = torch.empty(2 * block * p, dtype=torch.int32, device=vals.device)
    backend.all_gather(out, block_buf)
    return unpack(out[: 2 * total])


def distributed_kth_largest(backend: CommunicationBackend, mags: torch.Tensor, k: int) -> float:
    """Exact k-th largest positive value among every rank's ``mags`` (disjoint sets).

    Few candidates in all (<= :data:`GATHER_BELOW`): their magnitudes are all-gathered and every rank
    selects the same value locally. Otherwise a radix select: four rounds, each an ``all_reduce`` of a
    256-bin int32 histogram of one byte of the float32 bit pattern (non-negative floats order like
    their int32 bits). With fewer than ``k`` positive values in all, returns the smallest; with none, 0.
    """
    bits = mags.to(torch.float32).contiguous().view(torch.int32)
    first = radix_histogram(bits, 24, 0)  # the positive values, by their highest byte
    p, local = backend.world_size, int(first.sum())
    total = int(all_gather_counts(backend, [local]).sum()) if p > 1 else local
    if total == 0:
        return 0.0
    need = min(k, total)
    if total <= GATHER_BELOW:
        pos = mags[mags > 0].to(torch.float32).contiguous()
        every = backend.all_gather_v(pos)[0] if p > 1 else pos
        return float(torch.topk(every, need, sorted=False).values.min())
    prefix = 0
    for shift in (24, 16, 8, 0):  # each round counts the values whose higher bytes match the prefix
        hist = (first if shift == 24 else radix_histogram(bits, shift, prefix)).to(torch.int32)
        if p > 1:
            backend.all_reduce(hist, ReduceOp.SUM)
        above = torch.flip(torch.cumsum(torch.flip(hist.to(torch.int64), [0]), 0), [0]).tolist()
        d = max(i for i in range(256) if above[i] >= need)
        need -= above[d] - int(hist[d])
        prefix |= d << shift
    return float(torch.tensor([prefix], dtype=torch.int32).view(torch.float32).item())
