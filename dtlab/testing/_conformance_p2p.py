"""Conformance checks of the barrier and point-to-point messages. Re-exported by
:mod:`dtlab.testing.conformance`."""

from __future__ import annotations

import random
import time

import torch

from dtlab.backends.base import CommunicationBackend, P2POp
from dtlab.testing._checking import Problems

__all__ = [
    "check_any_source",
    "check_batch_isend_irecv",
    "check_message_streams",
    "check_barrier",
    "check_isend_irecv",
    "check_send_recv_order",
    "check_tags",
    "message_plan",
]

BARRIER_DELAY_S = 0.05
CLOCK_SLACK_S = 0.002


def _recv(pr: Problems, backend: CommunicationBackend, buf: torch.Tensor, src: int | None, tag: int) -> int:
    """``backend.recv`` that records an engine error instead of raising it, so the check still does
    all of its communication (a wrong message consumed is then reported, not turned into a hang)."""
    try:
        return backend.recv(buf, src, tag=tag)
    except Exception as exc:
        pr.add(f"recv(src={src}, tag={tag}) raised {type(exc).__name__}: {exc}")
        return -1


def check_barrier(backend: CommunicationBackend) -> None:
    """No rank leaves the barrier before the last one (rank 0, delayed) entered it.

    Compares ``time.time()`` stamps of all ranks, so it assumes the ranks share one clock (one host).
    """
    pr = Problems("barrier", backend.rank)
    if backend.rank == 0:
        time.sleep(BARRIER_DELAY_S)
    entered = time.time()
    backend.barrier()
    left = time.time()
    stamps = backend.all_gather_object((entered, left))
    last_in = max(e for e, _ in stamps)
    for r, (_, out) in enumerate(stamps):
        pr.expect(
            out >= last_in - CLOCK_SLACK_S,
            f"rank {r} left the barrier {last_in - out:.4f}s before the last rank entered it",
        )
    backend.barrier()  # a second, empty barrier must work too
    pr.raise_if_any()


def check_send_recv_order(backend: CommunicationBackend) -> None:
    """Messages between a pair with one tag arrive in the order sent: a ring of 6 messages each,
    alternating 2 and 40,000 int64 elements (so engines switch between eager and rendezvous sends)."""
    p, me = backend.world_size, backend.rank
    if p < 2:
        return
    pr = Problems("send_recv_order", backend.rank)
    right, left, dev = (me + 1) % p, (me - 1) % p, backend.device

    def size(k: int) -> int:
        return 2 if k % 2 == 0 else 40_000

    works = [
        backend.isend(torch.full((size(k),), me * 1000 + k, dtype=torch.int64, device=dev), right, tag=5)
        for k in range(6)
    ]
    for k in range(6):
        buf = torch.zeros(size(k), dtype=torch.int64, device=dev)
        src = _recv(pr, backend, buf, left, 5)
        pr.expect(src == left, f"recv #{k} from rank {left} returned source {src}")
        got = buf.unique().tolist()
        pr.expect(got == [left * 1000 + k], f"message #{k} from rank {left} holds {got[:4]}")
    for w in works:
        w.wait()
    pr.raise_if_any()


def message_plan(world_size: int, seed: int, count: int = 16) -> list[tuple[int, int, int, int]]:
    """``count`` messages ``(src, dst, tag, numel)`` among ``world_size`` ranks, drawn from ``seed``."""
    rng = random.Random(seed)
    plan = []
    for _ in range(count):
        src = rng.randrange(world_size)
        dst = rng.choice([r for r in range(world_size) if r != src])
        plan.append((src, dst, rng.randrange(3), rng.choice((1, 3, 1000))))
    return plan


def check_message_streams(backend: CommunicationBackend, seed: int = 0) -> None:
    """Random traffic (:func:`message_plan`): every rank posts its sends, waits at a barrier until
    every rank has posted (so each stream's messages are all queued, however the ranks are scheduled,
    and an engine that delivers a stream out of order is caught every time), then receives its
    messages stream by stream in an order drawn from the seed; each (source, tag) stream arrives in
    order."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    if p < 2:
        return
    pr = Problems("message_streams", me)
    plan = message_plan(p, seed)
    works = [
        backend.isend(torch.full((numel,), float(i), device=dev), dst, tag=tag)
        for i, (src, dst, tag, numel) in enumerate(plan)
        if src == me
    ]
    backend.barrier()
    streams: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, (src, dst, tag, numel) in enumerate(plan):
        if dst == me:
            streams.setdefault((src, tag), []).append((i, numel))
    rng = random.Random(seed * 7919 + me)  # this rank's receive order: part of the shared case data
    while streams:
        src, tag = key = rng.choice(sorted(streams))
        i, numel = streams[key].pop(0)
        if not streams[key]:
            del streams[key]
        buf = torch.full((numel,), -1.0, device=dev)
        got = _recv(pr, backend, buf, src, tag)
        values = buf.unique().tolist()
        pr.expect(
            got == src and values == [float(i)],
            f"message #{i} (from rank {src}, tag {tag}): recv returned source {got} and values {values[:4]}",
        )
    for w in works:
        w.wait()
    backend.barrier()
    pr.raise_if_any()


def check_tags(backend: CommunicationBackend) -> None:
    """Tags keep messages apart: receiving tag 12 before tag 11 gets each its own message."""
    p, me = backend.world_size, backend.rank
    if p < 2:
        return
    pr = Problems("tags", backend.rank)
    right, left, dev = (me + 1) % p, (me - 1) % p, backend.device
    w1 = backend.isend(torch.tensor([11.0, me], device=dev), right, tag=11)
    w2 = backend.isend(torch.tensor([12.0, me], device=dev), right, tag=12)
    b12, b11 = torch.zeros(2, device=dev), torch.zeros(2, device=dev)
    _recv(pr, backend, b12, left, 12)
    _recv(pr, backend, b11, left, 11)
    w1.wait()
    w2.wait()
    pr.expect(b12.tolist() == [12.0, left], f"tag 12 received {b12.tolist()}, expected [12.0, {left}]")
    pr.expect(b11.tolist() == [11.0, left], f"tag 11 received {b11.tolist()}, expected [11.0, {left}]")
    pr.raise_if_any()


def check_any_source(backend: CommunicationBackend) -> None:
    """``recv(src=None)`` on rank 0 returns each sender's rank with that sender's message."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    if p < 2:
        return
    pr = Problems("any_source", backend.rank)
    if me == 0:
        seen = []
        for _ in range(p - 1):
            buf = torch.zeros(3, dtype=torch.int32, device=dev)
            src = _recv(pr, backend, buf, None, 3)
            seen.append(src)
            pr.expect(buf.tolist() == [src] * 3, f"recv from any returned source {src} with {buf.tolist()}")
        pr.expect(sorted(seen) == list(range(1, p)), f"any-source receives came from {sorted(seen)}")
    else:
        backend.send(torch.full((3,), me, dtype=torch.int32, device=dev), 0, tag=3)
    backend.barrier()
    pr.raise_if_any()


def check_isend_irecv(backend: CommunicationBackend) -> None:
    """Two posted ``irecv``s per rank (from left and right, different tags) waited in reverse order."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    if p < 2:
        return
    pr = Problems("isend_irecv", backend.rank)
    right, left = (me + 1) % p, (me - 1) % p
    from_left = torch.zeros(4, dtype=torch.float64, device=dev)
    from_right = torch.zeros(4, dtype=torch.float64, device=dev)
    r1 = backend.irecv(from_left, left, tag=21)
    r2 = backend.irecv(from_right, right, tag=22)
    s1 = backend.isend(torch.full((4,), me + 0.5, dtype=torch.float64, device=dev), right, tag=21)
    s2 = backend.isend(torch.full((4,), me + 0.25, dtype=torch.float64, device=dev), left, tag=22)
    try:
        src2, src1 = r2.wait(), r1.wait()
    except Exception as exc:  # record it; the sends below still complete
        pr.add(f"irecv wait raised {type(exc).__name__}: {exc}")
        src2 = src1 = -1
    s1.wait()
    s2.wait()
    pr.expect(
        src1 == left and src2 == right, f"irecv waits returned sources {src1}, {src2}; want {left}, {right}"
    )
    pr.expect(from_left.tolist() == [left + 0.5] * 4, f"irecv from rank {left} got {from_left.tolist()}")
    pr.expect(from_right.tolist() == [right + 0.25] * 4, f"irecv from rank {right} got {from_right.tolist()}")
    pr.raise_if_any()


def check_batch_isend_irecv(backend: CommunicationBackend) -> None:
    """One batch per rank with every receive listed before every send (blocking receives in that
    order would deadlock on every engine): from and to both neighbours, a small and a 40,000-element
    message (eager and rendezvous sends), two messages to one peer with one tag (matched in posting
    order); handles waited in reverse; receives return their source; bytes counted as send/recv."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    if p < 2:
        return
    pr = Problems("batch_isend_irecv", me)
    right, left = (me + 1) % p, (me - 1) % p
    sizes = (3, 40_000)
    got = [torch.full((n,), -1.0, device=dev) for n in sizes]
    got_first = torch.zeros(2, dtype=torch.int64, device=dev)
    got_second = torch.zeros(2, dtype=torch.int64, device=dev)
    ops = [P2POp.recv(got[0], left, tag=31), P2POp.recv(got[1], right, tag=32)]
    ops += [P2POp.recv(got_first, left, tag=33), P2POp.recv(got_second, left, tag=33)]
    ops += [
        P2POp.send(torch.full((sizes[0],), me + 0.5, device=dev), right, tag=31),
        P2POp.send(torch.full((sizes[1],), me + 0.25, device=dev), left, tag=32),
        P2POp.send(torch.tensor([me, 1], dtype=torch.int64, device=dev), right, tag=33),
        P2POp.send(torch.tensor([me, 2], dtype=torch.int64, device=dev), right, tag=33),
    ]
    before = (backend.stats["send"], backend.stats["recv"])
    try:
        works = backend.batch_isend_irecv(ops)
        sources = [w.wait() for w in reversed(works)][::-1]
    except Exception as exc:  # recorded; the check still reports what it can
        pr.add(f"batch_isend_irecv raised {type(exc).__name__}: {exc}")
        pr.raise_if_any()
        return
    after = (backend.stats["send"], backend.stats["recv"])
    pr.expect(len(works) == len(ops), f"{len(works)} handles for {len(ops)} ops")
    pr.expect(sources[:4] == [left, right, left, left], f"receives returned sources {sources[:4]}")
    pr.expect(got[0].unique().tolist() == [left + 0.5], f"from rank {left} got {got[0].unique().tolist()}")
    pr.expect(
        got[1].unique().tolist() == [right + 0.25], f"from rank {right} got {got[1].unique().tolist()[:4]}"
    )
    pr.expect(
        got_first.tolist() == [left, 1] and got_second.tolist() == [left, 2],
        f"two messages with one tag arrived as {got_first.tolist()}, {got_second.tolist()} "
        "(want posting order)",
    )
    sent = 4 * (sizes[0] + sizes[1]) + 2 * 16
    pr.expect(
        (after[0].calls - before[0].calls, after[0].bytes_sent - before[0].bytes_sent) == (4, sent)
        and (after[1].calls - before[1].calls, after[1].bytes_received - before[1].bytes_received)
        == (4, sent),
        f"counters: {after[0].calls - before[0].calls} sends of {after[0].bytes_sent - before[0].bytes_sent} "
        f"bytes, {after[1].calls - before[1].calls} receives of "
        f"{after[1].bytes_received - before[1].bytes_received} bytes; want 4 of {sent} each",
    )
    pr.expect(backend.batch_isend_irecv([]) == [], "an empty batch must return no handles")
    for bad, words in (
        ([P2POp.send(torch.zeros(1, device=dev), me)], "is this rank itself"),
        ([("send", torch.zeros(1), right, 0)], "must be a P2POp"),
    ):
        try:
            backend.batch_isend_irecv(bad)  # type: ignore[arg-type]
            pr.add(f"batch_isend_irecv({bad!r}) did not raise")
        except ValueError as exc:
            pr.expect(words in str(exc), f"bad batch raised {exc!r}, expected it to say {words!r}")
    backend.barrier()
    pr.raise_if_any()
