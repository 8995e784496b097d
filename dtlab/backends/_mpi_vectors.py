"""The operations of :class:`~dtlab.backends.mpi.MPIBackend` whose sizes differ by rank, counts first:
``all_gather_v`` (every rank's size gathered, then ``Allgatherv``) and ``all_to_all`` (the counts
exchanged and checked, so mismatched sizes are a :class:`CollectiveMismatchError`, not memory
corruption, then one ``Alltoallv`` of the packed inputs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtlab.backends._mpi_support import _Buffers
from dtlab.errors import CollectiveMismatchError

__all__ = ["all_gather_v", "all_to_all"]

#: ``run(blocking, nonblocking, args, what)``: the backend's bounded way to complete an MPI call
Run = Callable[..., None]


def all_gather_v(comm: Any, buf: _Buffers, run: Run, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    c, p, es = comm, comm.Get_size(), input.element_size()
    counts = torch.zeros(p, dtype=torch.int64)
    mine = torch.tensor([input.numel()], dtype=torch.int64)
    run(c.Allgather, c.Iallgather, (buf.bytes(mine), buf.bytes(counts)), "all_gather_v(counts)")
    sizes = [int(x) for x in counts.tolist()]
    inp = buf.host(input)
    out = torch.empty(sum(sizes), dtype=input.dtype, device=inp.device)
    nbytes = [s * es for s in sizes]
    displs = [sum(nbytes[:r]) for r in range(p)]
    recv = [buf.raw(out), (nbytes, displs), buf.byte]
    run(c.Allgatherv, c.Iallgatherv, (buf.bytes(inp), recv), "all_gather_v")
    return out.to(input.device), sizes


def all_to_all(
    comm: Any, buf: _Buffers, run: Run, outputs: list[torch.Tensor], inputs: list[torch.Tensor]
) -> None:
    c, p, me = comm, comm.Get_size(), comm.Get_rank()
    es = inputs[0].element_size()
    send_n = torch.tensor([t.numel() for t in inputs], dtype=torch.int64)
    sent_to_me = torch.zeros(p, dtype=torch.int64)
    run(c.Alltoall, c.Ialltoall, (buf.bytes(send_n), buf.bytes(sent_to_me)), "all_to_all(counts)")
    errors = [
        f"rank {j} sends {int(sent_to_me[j])} elements but outputs[{j}] has {outputs[j].numel()}"
        for j in range(p)
        if int(sent_to_me[j]) != outputs[j].numel()
    ]
    if errors:
        raise CollectiveMismatchError(f"all_to_all on rank {me}: " + "; ".join(errors))
    send = torch.cat([buf.host(t).reshape(-1) for t in inputs])
    recv = torch.empty(sum(t.numel() for t in outputs), dtype=send.dtype, device=send.device)
    scount = [t.numel() * es for t in inputs]
    rcount = [t.numel() * es for t in outputs]
    sdis = [sum(scount[:j]) for j in range(p)]
    rdis = [sum(rcount[:j]) for j in range(p)]
    byte = buf.byte
    args = ([buf.raw(send), (scount, sdis), byte], [buf.raw(recv), (rcount, rdis), byte])
    run(c.Alltoallv, c.Ialltoallv, args, "all_to_all")
    offset = 0
    for out in outputs:
        out.view(-1).copy_(recv[offset : offset + out.numel()])
        offset += out.numel()
