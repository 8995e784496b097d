"""Conformance checks of world-level behaviour: object exchange, groups, byte counters, argument
validation and cross-rank identity. Re-exported by :mod:`dtlab.testing.conformance`."""

from __future__ import annotations

import pickle
import time

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.backends.torch_dist import TorchDistBackend
from dtlab.errors import DtlabError
from dtlab.testing._checking import Problems

__all__ = [
    "check_bad_arguments",
    "check_byte_counters",
    "check_groups",
    "check_identical_results",
    "check_objects",
]

GROUP_DELAY_S = 0.05


def check_objects(backend: CommunicationBackend) -> None:
    """``broadcast_object`` from every root and ``all_gather_object`` of objects of different sizes."""
    p, me = backend.world_size, backend.rank
    pr = Problems("objects", me)
    for src in range(p):
        obj = {"from": me, "payload": list(range(me + 3)), "text": "x" * me}
        got = backend.broadcast_object(obj, src)
        want = {"from": src, "payload": list(range(src + 3)), "text": "x" * src}
        pr.expect(got == want, f"broadcast_object(src={src}) returned {got!r}")
    mine = ("rank", me, [me] * me)
    got_all = backend.all_gather_object(mine)
    want_all = [("rank", r, [r] * r) for r in range(p)]
    pr.expect(got_all == want_all, f"all_gather_object returned {got_all!r}, expected {want_all!r}")
    pr.raise_if_any()


def check_groups(backend: CommunicationBackend) -> None:
    """``new_group``: renumbering in the given order, ``None`` for non-members, and two disjoint groups
    (even and odd ranks) running collectives at the same time without crosstalk."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    pr = Problems("groups", me)
    rev = backend.new_group(list(reversed(range(p))))
    if rev is None:
        pr.add("a group of all ranks returned None")
    else:
        pr.expect(
            rev.rank == p - 1 - me and rev.world_size == p,
            f"reversed group: rank {rev.rank} of {rev.world_size}",
        )
        order = rev.all_gather_object(me)
        pr.expect(order == list(reversed(range(p))), f"reversed group gathers world ranks {order}")
    solo = backend.new_group([p - 1])
    pr.expect((solo is None) == (me != p - 1), f"new_group([{p - 1}]) returned {solo!r} on rank {me}")
    if solo is not None:
        t = torch.tensor([float(me)], device=dev)
        solo.all_reduce(t)
        pr.expect(t.item() == me, f"all_reduce in a one-rank group changed {me} into {t.item()}")
    if p >= 2:
        evens, odds = list(range(0, p, 2)), list(range(1, p, 2))
        g_even, g_odd = backend.new_group(evens), backend.new_group(odds)
        mine, members = (g_even, evens) if me % 2 == 0 else (g_odd, odds)
        other = g_odd if me % 2 == 0 else g_even
        pr.expect(mine is not None and other is None, f"rank {me}: own group {mine!r}, other group {other!r}")
        if mine is not None:
            # the two groups run different collectives (sums vs. maxima of another shape) at the same
            # time: any crosstalk between them shows as a wrong value or a mismatch
            odd = me % 2
            for k in range(4):
                if k == 0 and len(evens) > 1 and (odd or me == evens[-1]):
                    # the other even ranks enter round 0 first, the odd group 10 ms later and the last
                    # even rank 50 ms later: the odd group must finish the round while the evens wait
                    time.sleep(GROUP_DELAY_S / 5 if odd else GROUP_DELAY_S)
                t = torch.full((1 + odd,), float(me * (k + 1)), dtype=torch.float64, device=dev)
                mine.all_reduce(t, ReduceOp.MAX if odd else ReduceOp.SUM)
                vals = [m * (k + 1) for m in members]
                want = float(max(vals) if odd else sum(vals))
                pr.expect(
                    t.tolist() == [want] * (1 + odd),
                    f"group {members} all_reduce #{k} gave {t.tolist()}, expected {want}",
                )
                b = torch.tensor([float(me)], device=dev)
                mine.broadcast(b, k % len(members))
                root = members[k % len(members)]
                pr.expect(b.item() == root, f"group {members} broadcast from {root} gave {b.item()}")
    backend.barrier()
    pr.raise_if_any()


def check_byte_counters(backend: CommunicationBackend) -> None:
    """``stats`` counts calls and bytes per kind exactly by the ring convention; ``reset()`` zeroes."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    pr = Problems("byte_counters", me)
    backend.barrier()
    backend.stats.reset()
    pr.expect(backend.stats.calls == 0 and backend.stats.bytes_sent == 0, f"after reset: {backend.stats!r}")
    n = 24  # float32 elements: 96 bytes, not a multiple of every P
    nb = 4 * n
    want: dict[str, tuple[int, int, int]] = {}
    backend.all_reduce(torch.ones(n, device=dev))
    want["all_reduce"] = (1, 2 * (p - 1) * nb // p, 2 * (p - 1) * nb // p)
    backend.reduce_scatter(torch.zeros(n, device=dev), torch.ones(p * n, device=dev))
    want["reduce_scatter"] = (1, (p - 1) * nb, (p - 1) * nb)
    backend.all_gather(torch.zeros(p * n, device=dev), torch.ones(n, device=dev))
    want["all_gather"] = (1, (p - 1) * nb, (p - 1) * nb)
    src = p - 1
    backend.broadcast(torch.ones(n, device=dev), src)
    want["broadcast"] = (1, nb if p > 1 and me != (src - 1) % p else 0, nb if p > 1 and me != src else 0)
    dst = 0
    backend.reduce(torch.ones(n, device=dev), dst)
    want["reduce"] = (1, nb if p > 1 and me != dst else 0, nb if p > 1 and me != (dst + 1) % p else 0)
    counts = [r + 1 for r in range(p)]
    backend.all_gather_v(torch.ones(counts[me], dtype=torch.float64, device=dev))
    total = sum(counts)
    want["all_gather_v"] = (
        1,
        (total - counts[(me + 1) % p]) * 8 + 8 * (p - 1),
        (total - counts[me]) * 8 + 8 * (p - 1),
    )
    if isinstance(backend, TorchDistBackend):  # gloo/NCCL: every rank sends max(counts), padded
        padded = (p - 1) * (max(counts) * 8 + 8)
        want["all_gather_v"] = (1, padded, padded)
    ins = [torch.ones(me + j + 1, dtype=torch.int32, device=dev) for j in range(p)]
    outs = [torch.zeros(i + me + 1, dtype=torch.int32, device=dev) for i in range(p)]
    backend.all_to_all(outs, ins)
    a2a_sent = sum(4 * (me + j + 1) for j in range(p) if j != me)
    a2a_recv = sum(4 * (i + me + 1) for i in range(p) if i != me)
    want["all_to_all"] = (1, a2a_sent, a2a_recv)
    backend.barrier()
    want["barrier"] = (1, 0, 0)
    if p >= 2:
        work = backend.isend(torch.ones(5, dtype=torch.float64, device=dev), (me + 1) % p, tag=9)
        backend.recv(torch.zeros(5, dtype=torch.float64, device=dev), (me - 1) % p, tag=9)
        work.wait()
        want["send"] = (1, 40, 0)
        want["recv"] = (1, 0, 40)
    got = backend.stats.snapshot()
    for kind, (calls, sent, received) in want.items():
        g = got.get(kind, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
        pr.expect(
            (g["calls"], g["bytes_sent"], g["bytes_received"]) == (calls, sent, received),
            f"{kind}: counted calls/sent/received {(g['calls'], g['bytes_sent'], g['bytes_received'])}, "
            f"ring convention says {(calls, sent, received)} (P={p})",
        )
    obj = {"k": list(range(me))}
    backend.stats.reset()
    backend.broadcast_object(obj, 0)
    size0 = len(pickle.dumps({"k": []}))
    bo = backend.stats["broadcast_object"]
    want_bo = (size0 if p > 1 and me != p - 1 else 0, size0 if p > 1 and me != 0 else 0)
    pr.expect(
        (bo.bytes_sent, bo.bytes_received) == want_bo, f"broadcast_object sent/received {bo}, want {want_bo}"
    )
    group = backend.new_group(list(reversed(range(p))))
    backend.stats.reset()
    if group is not None:
        group.stats.reset()
        group.all_reduce(torch.ones(n, device=dev))
        moved = 2 * (p - 1) * nb // p
        for who, stats in (("the group", group.stats), ("its parent", backend.stats)):
            s = stats["all_reduce"]
            pr.expect(
                (s.calls, s.bytes_sent, s.bytes_received) == (1, moved, moved),
                f"a group's all_reduce counted by {who} as {s}, want 1 call and {moved} bytes each way",
            )
    pr.raise_if_any()


def _expect_error(pr: Problems, what: str, kind: type[Exception], fn: object, *args: object) -> None:
    """``fn(*args)`` must raise ``kind`` that is also a :class:`DtlabError` (every dtlab error is one)."""
    try:
        fn(*args)  # type: ignore[operator]
    except kind as exc:
        pr.expect(isinstance(exc, DtlabError), f"{what} raised {type(exc).__name__}, not a DtlabError")
        return
    except Exception as exc:
        pr.add(f"{what} raised {type(exc).__name__}: {exc}; expected {kind.__name__}")
        return
    pr.add(f"{what} did not raise; expected {kind.__name__}")


def check_bad_arguments(backend: CommunicationBackend) -> None:
    """Wrong sizes, roots out of range, AVG on integers and bad groups raise before communicating."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    pr = Problems("bad_arguments", me)
    f = torch.zeros(3, device=dev)
    _expect_error(
        pr,
        "reduce_scatter with a wrong input size",
        ValueError,
        backend.reduce_scatter,
        f,
        torch.zeros(3 * p + 1, device=dev),
    )
    _expect_error(
        pr,
        "all_gather with a wrong output size",
        ValueError,
        backend.all_gather,
        torch.zeros(3 * p + 1, device=dev),
        f,
    )
    _expect_error(pr, f"broadcast(src={p})", ValueError, backend.broadcast, f, p)
    _expect_error(pr, "reduce(dst=-1)", ValueError, backend.reduce, f, -1)
    _expect_error(pr, f"broadcast_object(src={p})", ValueError, backend.broadcast_object, 1, p)
    _expect_error(pr, f"send(dst={p})", ValueError, backend.send, f, p)
    _expect_error(pr, "send to itself", ValueError, backend.send, f, me)
    _expect_error(pr, "recv(src=-1)", ValueError, backend.recv, f, -1)
    _expect_error(
        pr,
        "all_reduce AVG on int64",
        TypeError,
        backend.all_reduce,
        torch.zeros(2, dtype=torch.int64, device=dev),
        ReduceOp.AVG,
    )
    _expect_error(pr, "all_reduce of a list", TypeError, backend.all_reduce, [1.0])
    _expect_error(pr, "all_reduce with op='sum'", TypeError, backend.all_reduce, f, "sum")
    strided = torch.zeros(4, 2, device=dev).t()
    _expect_error(pr, "all_reduce of a non-contiguous tensor", ValueError, backend.all_reduce, strided)
    cplx = torch.zeros(2, dtype=torch.complex64, device=dev)
    _expect_error(pr, "all_reduce of complex64", TypeError, backend.all_reduce, cplx)
    _expect_error(
        pr,
        "reduce_scatter from float64 into float32",
        TypeError,
        backend.reduce_scatter,
        f,
        torch.zeros(3 * p, dtype=torch.float64, device=dev),
    )
    gathered = torch.zeros(8 * p, device=dev)
    _expect_error(pr, "all_gather of a strided input", ValueError, backend.all_gather, gathered, strided)
    _expect_error(
        pr, "all_to_all with too few tensors", ValueError, backend.all_to_all, [f] * (p + 1), [f] * (p + 1)
    )
    _expect_error(pr, f"new_group([{p}])", ValueError, backend.new_group, [p])
    _expect_error(pr, "new_group([0, 0])", ValueError, backend.new_group, [0, 0])
    try:
        backend.reduce_scatter(f, torch.zeros(3 * p + 1, device=dev))
    except ValueError as exc:
        pr.expect(
            str(3 * p + 1) in str(exc), f"reduce_scatter's error does not name the size {3 * p + 1}: {exc}"
        )
    backend.barrier()  # nothing above may have started a collective
    pr.raise_if_any()


def check_identical_results(backend: CommunicationBackend) -> None:
    """Reductions of random (inexact) floats give bitwise identical results on every rank."""
    pr = Problems("identical_results", backend.rank)
    g = torch.Generator().manual_seed(1234 + backend.rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.randn(257, generator=g).to(dtype).to(backend.device)
        backend.all_reduce(t)
        everyone = backend.all_gather_object(t.cpu())
        for r, other in enumerate(everyone):
            pr.expect(
                torch.equal(other, everyone[0]),
                f"{dtype} all_reduce: rank {r}'s result differs from rank 0's",
            )
    pr.raise_if_any()
