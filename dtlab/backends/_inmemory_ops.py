"""The in-memory collectives, run once by the last rank to arrive on every rank's deposited tensors.

Each ``lead_*`` function gets the payloads of all ranks in rank order and writes every rank's result
in place. Reductions run in rank order (``((x0 op x1) op x2) ...``), so results do not depend on
which thread leads. Inputs are read by reference; a copy is made only where outputs and inputs share
memory (in-place ``all_gather``/``reduce_scatter``), so that nothing is overwritten before it is read.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dtlab.backends._checked import describe_call
from dtlab.backends.types import ReduceOp
from dtlab.errors import CollectiveMismatchError

__all__ = [
    "describe_call",
    "leader_mode",
    "lead_all_gather",
    "lead_all_gather_v",
    "lead_all_reduce",
    "lead_all_to_all",
    "lead_broadcast",
    "lead_reduce",
    "lead_reduce_scatter",
    "reduce_into",
]

SMALL_BYTES = 256 * 1024  # below this, fewer and larger tensor ops beat minimal memory traffic
_BINARY = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PRODUCT: torch.mul}


def _tensors(payloads: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in payloads:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, list | tuple):
            out.extend(_tensors(item))
    return out


def leader_mode(payloads: list[Any]) -> AbstractContextManager[Any]:
    """The leader works on every rank's tensors, whatever grad mode each rank's thread is in.

    Collectives are not differentiable (like ``torch.distributed``'s): the leader runs without
    autograd when some tensor requires grad, and in inference mode when some rank passed an inference
    tensor (which may only be updated in place inside inference mode). Otherwise nothing changes (the
    common case, and entering ``torch.no_grad()`` costs microseconds).
    """
    grad = False
    for t in _tensors(payloads):
        if t.is_inference():
            return torch.inference_mode()
        grad = grad or t.requires_grad
    return torch.no_grad() if grad and torch.is_grad_enabled() else nullcontext()


def _accumulate(acc: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp, count: int) -> None:
    """``acc = acc (op) parts[0] (op) parts[1] ...`` in place; AVG divides by ``count`` at the end."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        for p in parts:
            acc.add_(p)
        if op is ReduceOp.AVG:
            acc.div_(count)
        return
    fn = _BINARY[op]
    for p in parts:
        fn(acc, p, out=acc)


def reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    """``out = parts[0] (op) parts[1] (op) ...`` in rank order; ``out`` must not alias a part."""
    if len(parts) == 1:
        out.copy_(parts[0])
        if op is ReduceOp.AVG:
            out.div_(1)
        return
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        torch.add(parts[0], parts[1], out=out)
    else:
        _BINARY[op](parts[0], parts[1], out=out)
    _accumulate(out, parts[2:], ReduceOp.SUM if op is ReduceOp.AVG else op, len(parts))
    if op is ReduceOp.AVG:
        out.div_(len(parts))


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.nbytes


def _distinct(ts: list[torch.Tensor]) -> bool:
    """True if no two of these contiguous tensors overlap in memory."""
    spans = sorted(_span(t) for t in ts if t.nbytes)
    return all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


def _overlap(outs: list[torch.Tensor], ins: list[torch.Tensor]) -> bool:
    """True if some output shares memory with some input (contiguous tensors)."""
    spans = sorted([(*_span(t), 0) for t in outs if t.nbytes] + [(*_span(t), 1) for t in ins if t.nbytes])
    reach = [0, 0]  # the furthest end seen so far of an output span and of an input span
    for start, end, kind in spans:
        if start < reach[1 - kind]:
            return True
        reach[kind] = max(reach[kind], end)
    return False


def _flat(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dim() == 1 else t.view(-1) for t in ts]


def lead_all_reduce(tensors: list[torch.Tensor], op: ReduceOp) -> None:
    flat = _flat(tensors)
    if _distinct(flat):  # accumulate into rank 0's tensor, then copy it to the others
        _accumulate(flat[0], flat[1:], op, len(flat))
        for t in flat[1:]:
            t.copy_(flat[0])
        return
    result = torch.empty_like(flat[0])
    reduce_into(result, flat, op)
    for t in flat:
        t.copy_(result)


def lead_reduce(tensors: list[torch.Tensor], dst: int, op: ReduceOp) -> None:
    flat = _flat(tensors)
    if dst == 0 and _distinct(flat):
        _accumulate(flat[0], flat[1:], op, len(flat))
        return
    result = torch.empty_like(flat[0])
    reduce_into(result, flat, op)
    flat[dst].copy_(result)


def lead_broadcast(tensors: list[torch.Tensor], src: int) -> None:
    source = tensors[src]
    for r, t in enumerate(tensors):
        if r != src and t.data_ptr() != source.data_ptr():
            t.copy_(source)


def lead_reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]], op: ReduceOp) -> None:
    outs = _flat([o for o, _ in pairs])
    ins = _flat([i for _, i in pairs])
    n = outs[0].numel()
    if _overlap(outs, ins):  # some output lives inside an input: read everything first
        results = [torch.empty_like(outs[0]) for _ in outs]
        for r, res in enumerate(results):
            reduce_into(res, [t[r * n : (r + 1) * n] for t in ins], op)
        for out, res in zip(outs, results, strict=True):
            out.copy_(res)
        return
    if len(ins) > 2 and n * outs[0].element_size() * len(ins) <= SMALL_BYTES:
        # small: reduce the whole buffers once (P-1 ops) and hand out the shards (P copies) instead
        # of P reductions of P tiny chunks each; the same rank-order arithmetic per element
        full = torch.empty_like(ins[0])
        reduce_into(full, ins, op)
        for r, out in enumerate(outs):
            out.copy_(full[r * n : (r + 1) * n])
        return
    for r, out in enumerate(outs):
        reduce_into(out, [t[r * n : (r + 1) * n] for t in ins], op)


def lead_all_gather(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    outs = _flat([o for o, _ in pairs])
    ins = _flat([i for _, i in pairs])
    if _overlap(outs, ins):  # an input lives inside an output (in-place all-gather)
        ins = [t.clone() for t in ins]
    for out in outs:
        torch.cat(ins, out=out)


def lead_all_gather_v(inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    joined = torch.cat([t.reshape(-1) for t in inputs])
    return [joined] + [joined.clone() for _ in inputs[1:]], [int(t.numel()) for t in inputs]


def lead_all_to_all(payloads: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
    p = len(payloads)
    errors = [
        f"rank {i} sends {payloads[i][1][j].numel()} elements to rank {j}, whose outputs[{i}] has "
        f"{payloads[j][0][i].numel()}"
        for i in range(p)
        for j in range(p)
        if payloads[i][1][j].numel() != payloads[j][0][i].numel()
    ]
    if errors:
        raise CollectiveMismatchError("all_to_all sizes do not match: " + "; ".join(errors))
    outs = [t for o, _ in payloads for t in o]
    ins = [t for _, i in payloads for t in i]
    clone = _overlap(outs, ins)
    sources = [[t.clone() if clone else t for t in i] for _, i in payloads]
    for j in range(p):
        for i in range(p):
            payloads[j][0][i].view(-1).copy_(sources[i][j].reshape(-1))
