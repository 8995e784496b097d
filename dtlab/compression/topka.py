"""``TopkA``: every rank's exact local top-k, exchanged by an all-gather and summed (``TopK`` alias).

Per rank: ``k`` index-value pairs in, ``(P-1) k`` pairs sent and received (ring all-gather). The
result holds up to ``P k`` nonzeros: the average over ranks of every rank's local top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression.base import Exchange
from dtlab.compression.kernels import sum_sorted_runs
from dtlab.compression.sparse import LocalTopk, local_topk, pack, unpack

__all__ = ["TopK", "TopkA"]


@dataclass(frozen=True, kw_only=True)
class TopkA(LocalTopk):
    """All-gather of local top-k (``k = density * numel``) and a sum of everything gathered."""

    name: ClassVar[str] = "topka"

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p, k = backend.world_size, self.k(acc.numel())
        t0 = time.perf_counter()
        idx, _ = local_topk(acc, k, state["work"])
        # a fixed k per rank keeps the gather fixed-size; zeros (never selected) are padded as
        # index 0 with value 0.0, which adds nothing
        buf = torch.zeros(2 * k, dtype=torch.int32, device=acc.device)
        buf[: 2 * idx.numel()] = pack(idx, acc.index_select(0, idx))
        select_s = time.perf_counter() - t0
        out = torch.empty(2 * k * p, dtype=torch.int32, device=acc.device)
        backend.all_gather(out, buf)
        gidx, gvals = unpack(out)
        # every rank's block: its sorted entries (nonzero values), then the padding (0.0 at index 0)
        real = gvals != 0
        counts = real.view(p, k).sum(dim=1).tolist()
        uniq, sums = sum_sorted_runs(gidx[real], gvals[real], counts)
        selected = int(torch.count_nonzero(sums))
        return Exchange.sparse(uniq, sums.div_(p), idx, idx.numel(), selected, select_s)


#: the top-k compressor of the dense-shaped path is the TopkA exchange
TopK = TopkA
