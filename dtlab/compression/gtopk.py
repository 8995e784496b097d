"""``GTopk``: global top-k selected by a tree of pairwise merges (Shi et al., gTop-k S-SGD).

Each rank starts from its exact local top-k. In round ``r`` (``ceil(log2 P)`` rounds) rank
``i + 2^r`` sends its ``<= k`` entries to rank ``i`` (for ``i`` a multiple of ``2^(r+1)``), which sums
entries at common indices and keeps the top-k of the merge. Rank 0 ends with the global selection and
broadcasts its ``<= k`` indices.

Values: the reference code takes the tree's partial sums as the result, which silently drops every
contribution pruned in an early round (and error feedback then loses it). Here the values at the
selected indices are made exact with one ``k``-element all-reduce of every rank's accumulated
gradient there, so each rank's contribution is precisely ``acc[selected]`` and nothing is lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Exchange
from dtlab.compression.kernels import sum_sorted_runs
from dtlab.compression.sparse import TAG, LocalTopk, local_topk, pack, unpack

__all__ = ["GTopk"]


def _merge_topk(
    a_idx: torch.Tensor, a_vals: torch.Tensor, b_idx: torch.Tensor, b_vals: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # both sides are sorted without repeats: merged, summed where they meet
    counts = [a_idx.numel(), b_idx.numel()]
    uniq, sums = sum_sorted_runs(torch.cat([a_idx, b_idx]), torch.cat([a_vals, b_vals]), counts)
    if uniq.numel() > k:
        keep = torch.sort(torch.topk(sums.abs(), k, sorted=False).indices).values
        uniq, sums = uniq[keep], sums[keep]
    return uniq, sums


@dataclass(frozen=True, kw_only=True)
class GTopk(LocalTopk):
    """Tree-based global top-k (log2 P rounds), exact values by a k-element all-reduce."""

    name: ClassVar[str] = "gtopk"

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p, me, k = backend.world_size, backend.rank, self.k(acc.numel())
        dev = acc.device
        t0 = time.perf_counter()
        idx, _ = local_topk(acc, k, state["work"])
        local = idx.numel()
        select_s = time.perf_counter() - t0
        cur_idx, cur_vals = idx, acc.index_select(0, idx)
        step = 1
        while step < p:
            if me % (2 * step) == step:
                backend.send(torch.tensor([cur_idx.numel()], dtype=torch.int64, device=dev), me - step, TAG)
                if cur_idx.numel():
                    backend.send(pack(cur_idx, cur_vals), me - step, TAG)
            elif me % (2 * step) == 0 and me + step < p:
                cnt = torch.empty(1, dtype=torch.int64, device=dev)
                backend.recv(cnt, me + step, TAG)
                m = int(cnt.item())
                if m:
                    buf = torch.empty(2 * m, dtype=torch.int32, device=dev)
                    backend.recv(buf, me + step, TAG)
                    o_idx, o_vals = unpack(buf)
                    t1 = time.perf_counter()
                    cur_idx, cur_vals = _merge_topk(cur_idx, cur_vals, o_idx, o_vals, k)
                    select_s += time.perf_counter() - t1
            step *= 2
        final = torch.full((k + 1,), -1, dtype=torch.int64, device=dev)
        if me == 0:
            final[0] = cur_idx.numel()
            final[1 : 1 + cur_idx.numel()] = cur_idx
        if p > 1:
            backend.broadcast(final, 0)
        m = int(final[0].item())
        sel = final[1 : 1 + m]
        vals = acc.index_select(0, sel)
        if p > 1:
            backend.all_reduce(vals, ReduceOp.SUM)
        return Exchange.sparse(sel, vals.div_(p), sel, local, m, select_s)
