"""The conformance suite: every operation of :class:`CommunicationBackend` against a direct computation.

Written only against the interface, so the same checks run on the in-memory world, MPI, Gloo and
NCCL. Each ``check_*`` function is called by every rank with the same case data; it does all of its
communication first and then raises :class:`ConformanceFailure` naming the values. Checks that need
a world size they do not have return without doing anything.

    results = run_conformance(backend)          # on every rank
    failed = {k: v for k, v in results.items() if v is not None}

Case data (shapes, dtypes, ops, roots, counts) are explicit values shared by every rank
(:func:`default_cases` derives them from a seed), never per-rank randomness; each rank's input is a
deterministic function of the case and the rank (:func:`case_input`), so every rank can compute
every other rank's input and the expected result directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import ArgumentError
from dtlab.testing._checking import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    Case,
    ConformanceFailure,
    Problems,
    SizesCase,
    case_input,
    expected_reduction,
)
from dtlab.testing._conformance_groups import check_mesh, check_split
from dtlab.testing._conformance_p2p import (
    check_any_source,
    check_barrier,
    check_batch_isend_irecv,
    check_isend_irecv,
    check_message_streams,
    check_send_recv_order,
    check_tags,
)
from dtlab.testing._conformance_world import (
    check_bad_arguments,
    check_byte_counters,
    check_groups,
    check_identical_results,
    check_objects,
)

__all__ = [
    "CHECK_NAMES",
    "Case",
    "ConformanceCases",
    "ConformanceFailure",
    "SizesCase",
    "case_input",
    "check_all_gather",
    "check_all_gather_v",
    "check_all_reduce",
    "check_all_to_all",
    "check_any_source",
    "check_bad_arguments",
    "check_barrier",
    "check_batch_isend_irecv",
    "check_broadcast",
    "check_byte_counters",
    "check_groups",
    "check_identical_results",
    "check_isend_irecv",
    "check_mesh",
    "check_message_streams",
    "check_nonblocking",
    "check_objects",
    "check_reduce",
    "check_reduce_scatter",
    "check_send_recv_order",
    "check_split",
    "check_tags",
    "default_cases",
    "run_cases",
    "run_conformance",
]


@dataclass(frozen=True)
class ConformanceCases:
    """The case data of one run: ``collectives`` drive every tensor collective, ``sizes`` the
    variable-sized ones (``all_gather_v``, ``all_to_all``)."""

    collectives: tuple[Case, ...]
    sizes: tuple[SizesCase, ...]


def default_cases(seed: int = 0) -> ConformanceCases:
    """Every dtype with every applicable op (AVG only on floats), odd shapes, scalar and 3-d tensors,
    roots spread over ranks, two larger tensors; sizes in which rank 1 contributes no elements, and
    an all-empty one. Deterministic in ``seed``."""
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = [(1,), (7,), (3, 5), (), (2, 3, 4), (33,)]
    collectives: list[Case] = []
    for dtype in ALL_DTYPES:
        ops = list(ReduceOp) if dtype in FLOAT_DTYPES else [op for op in ReduceOp if op is not ReduceOp.AVG]
        for op in ops:
            collectives.append(
                Case(rng.choice(shapes), dtype, op, root=rng.randrange(8), seed=rng.randrange(1 << 30))
            )
    # larger messages, where engines switch algorithms (ring, rendezvous protocol)
    collectives.append(Case((20_001,), torch.float32, ReduceOp.SUM, root=3, seed=rng.randrange(1 << 30)))
    collectives.append(Case((3, 4_001), torch.bfloat16, ReduceOp.MAX, root=5, seed=rng.randrange(1 << 30)))
    # rank 1 contributes nothing in every case (counts cycle over ranks), and one case is all empty
    sizes = [
        SizesCase(
            (rng.randrange(1, 6), 0, *[rng.randrange(0, 6) for _ in range(rng.randrange(0, 4))]),
            dtype,
            rng.randrange(1 << 30),
        )
        for dtype in ALL_DTYPES
    ]
    sizes.append(SizesCase((0,), torch.float32, 7))
    return ConformanceCases(tuple(collectives), tuple(sizes))


def _inputs(case: Case, p: int, flat_factor: int | None = None) -> list[torch.Tensor]:
    """Every rank's input of ``case`` (``flat_factor``: flat with that many times the elements)."""
    shape = (flat_factor * case.numel,) if flat_factor is not None else case.shape
    return [case_input(shape, case.dtype, case.seed, r, case.op) for r in range(p)]


def _on(backend: CommunicationBackend, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the backend's device (the original stays as the reference)."""
    return t.clone().to(backend.device)


# ---------------------------------------------------------------------------------------- collectives
def check_all_reduce(backend: CommunicationBackend, case: Case) -> None:
    """``all_reduce`` leaves the reduction of every rank's input on every rank."""
    pr = Problems("all_reduce", backend.rank)
    inputs = _inputs(case, backend.world_size)
    t = _on(backend, inputs[backend.rank])
    backend.all_reduce(t, case.op)
    pr.compare(f"all_reduce({case.label()})", t, expected_reduction(inputs, case.op, case.dtype), case.op)
    pr.raise_if_any()


def check_reduce(backend: CommunicationBackend, case: Case) -> None:
    """``reduce`` leaves the reduction on ``dst``; every other rank keeps its input."""
    pr = Problems("reduce", backend.rank)
    p, me = backend.world_size, backend.rank
    dst = case.root % p
    inputs = _inputs(case, p)
    t = _on(backend, inputs[me])
    backend.reduce(t, dst, case.op)
    want = expected_reduction(inputs, case.op, case.dtype) if me == dst else inputs[me]
    pr.compare(f"reduce({case.label()}, dst={dst})", t, want, case.op)
    pr.raise_if_any()


def check_broadcast(backend: CommunicationBackend, case: Case) -> None:
    """``broadcast`` copies ``src``'s tensor to every rank."""
    pr = Problems("broadcast", backend.rank)
    p, me = backend.world_size, backend.rank
    src = case.root % p
    inputs = _inputs(case, p)
    t = _on(backend, inputs[me])
    backend.broadcast(t, src)
    pr.compare(f"broadcast({case.label()}, src={src})", t, inputs[src])
    pr.raise_if_any()


def check_reduce_scatter(backend: CommunicationBackend, case: Case) -> None:
    """``reduce_scatter``: rank r receives the reduced r-th chunk of the flat inputs."""
    pr = Problems("reduce_scatter", backend.rank)
    p, me, n = backend.world_size, backend.rank, case.numel
    inputs = _inputs(case, p, flat_factor=p)
    out = torch.full(case.shape, 3, dtype=case.dtype, device=backend.device)
    backend.reduce_scatter(out, _on(backend, inputs[me]), case.op)
    full = expected_reduction(inputs, case.op, case.dtype)
    pr.compare(
        f"reduce_scatter({case.label()})", out, full[me * n : (me + 1) * n].reshape(case.shape), case.op
    )
    pr.raise_if_any()


def check_all_gather(backend: CommunicationBackend, case: Case) -> None:
    """``all_gather``: the output holds every rank's input in rank order; the input is untouched."""
    pr = Problems("all_gather", backend.rank)
    p, me = backend.world_size, backend.rank
    inputs = _inputs(case, p)
    inp = _on(backend, inputs[me])
    out = torch.zeros(p * case.numel, dtype=case.dtype, device=backend.device)
    backend.all_gather(out, inp)
    pr.compare(f"all_gather({case.label()})", out, torch.cat([t.reshape(-1) for t in inputs]))
    pr.compare(f"all_gather({case.label()}) input afterwards", inp, inputs[me])
    pr.raise_if_any()


def check_nonblocking(backend: CommunicationBackend, case: Case) -> None:
    """``iall_reduce``, ``ireduce_scatter``, ``iall_gather`` issued together, waited in reverse order."""
    pr = Problems("nonblocking", backend.rank)
    p, me, n, dev = backend.world_size, backend.rank, case.numel, backend.device
    red = _inputs(case, p)
    rs_in = _inputs(Case(case.shape, case.dtype, case.op, case.root, case.seed + 1), p, flat_factor=p)
    ag_in = _inputs(Case(case.shape, case.dtype, case.op, case.root, case.seed + 2), p)
    a = _on(backend, red[me])
    rs_out = torch.zeros(case.shape, dtype=case.dtype, device=dev)
    ag_out = torch.zeros(p * n, dtype=case.dtype, device=dev)
    works = [
        backend.iall_reduce(a, case.op),
        backend.ireduce_scatter(rs_out, _on(backend, rs_in[me]), case.op),
        backend.iall_gather(ag_out, _on(backend, ag_in[me])),
    ]
    for w in reversed(works):
        w.wait()
    pr.compare(f"iall_reduce({case.label()})", a, expected_reduction(red, case.op, case.dtype), case.op)
    full = expected_reduction(rs_in, case.op, case.dtype)
    pr.compare(
        f"ireduce_scatter({case.label()})", rs_out, full[me * n : (me + 1) * n].reshape(case.shape), case.op
    )
    pr.compare(f"iall_gather({case.label()})", ag_out, torch.cat([t.reshape(-1) for t in ag_in]))
    pr.raise_if_any()


def check_all_gather_v(backend: CommunicationBackend, case: SizesCase) -> None:
    """Variable-sized all-gather, including ranks with no elements: data and counts in rank order."""
    pr = Problems("all_gather_v", backend.rank)
    p, me = backend.world_size, backend.rank
    inputs = [case_input((case.count(r),), case.dtype, case.seed, r) for r in range(p)]
    out, counts = backend.all_gather_v(_on(backend, inputs[me]))
    pr.expect(
        list(counts) == [case.count(r) for r in range(p)],
        f"all_gather_v(counts={case.counts}): got counts {list(counts)}, expected "
        f"{[case.count(r) for r in range(p)]}",
    )
    pr.compare(f"all_gather_v(counts={case.counts}, dtype={case.dtype})", out, torch.cat(inputs))
    pr.raise_if_any()


def check_all_to_all(backend: CommunicationBackend, case: SizesCase) -> None:
    """``all_to_all`` with a different element count for every (sender, receiver) pair."""
    pr = Problems("all_to_all", backend.rank)
    p, me, dev = backend.world_size, backend.rank, backend.device

    def block(i: int, j: int) -> torch.Tensor:  # what rank i sends to rank j
        return case_input((case.count(i * p + j),), case.dtype, case.seed, i * p + j)

    inputs = [_on(backend, block(me, j)) for j in range(p)]
    outputs = [torch.zeros(case.count(i * p + me), dtype=case.dtype, device=dev) for i in range(p)]
    backend.all_to_all(outputs, inputs)
    for i in range(p):
        pr.compare(
            f"all_to_all(counts={case.counts}, dtype={case.dtype}) from rank {i}", outputs[i], block(i, me)
        )
    pr.raise_if_any()


# ---------------------------------------------------------------------------------------- driver
_CASE_CHECKS: tuple[tuple[str, Callable[[CommunicationBackend, Case], None]], ...] = (
    ("all_reduce", check_all_reduce),
    ("reduce", check_reduce),
    ("broadcast", check_broadcast),
    ("reduce_scatter", check_reduce_scatter),
    ("all_gather", check_all_gather),
    ("nonblocking", check_nonblocking),
)
_SIZES_CHECKS: tuple[tuple[str, Callable[[CommunicationBackend, SizesCase], None]], ...] = (
    ("all_gather_v", check_all_gather_v),
    ("all_to_all", check_all_to_all),
)
_PLAIN_CHECKS: tuple[tuple[str, Callable[[CommunicationBackend], None]], ...] = (
    ("barrier", check_barrier),
    ("send_recv_order", check_send_recv_order),
    ("tags", check_tags),
    ("message_streams", check_message_streams),
    ("any_source", check_any_source),
    ("isend_irecv", check_isend_irecv),
    ("batch_isend_irecv", check_batch_isend_irecv),
    ("objects", check_objects),
    ("groups", check_groups),
    ("split", check_split),
    ("mesh", check_mesh),
    ("byte_counters", check_byte_counters),
    ("bad_arguments", check_bad_arguments),
    ("identical_results", check_identical_results),
)
CHECK_NAMES: tuple[str, ...] = tuple(n for n, _ in _CASE_CHECKS + _SIZES_CHECKS + _PLAIN_CHECKS)


def run_cases(backend: CommunicationBackend, cases: ConformanceCases) -> list[str]:
    """Every case check on every case of ``cases``; returns this rank's failures (empty: all passed).

    For drawn case data (``dtlab.testing.strategies``): ``run_world(P, run_cases, cases)`` or
    ``spawn_world(P, run_cases, cases, backend="mpi")``. Call it on all ranks alike.
    """
    failures: list[str] = []
    for case in cases.collectives:
        for _, check in _CASE_CHECKS:
            try:
                check(backend, case)
            except ConformanceFailure as exc:
                failures.append(str(exc))
    for sizes in cases.sizes:
        for _, scheck in _SIZES_CHECKS:
            try:
                scheck(backend, sizes)
            except ConformanceFailure as exc:
                failures.append(str(exc))
    return failures


def run_conformance(
    backend: CommunicationBackend, cases: ConformanceCases | None = None, only: Sequence[str] | None = None
) -> dict[str, str | None]:
    """Run every check (or those named in ``only``) on every rank; call it on all ranks alike.

    Returns ``{check name: None if it passed on every rank, else the failures' text}``, the same dict
    on every rank (outcomes are exchanged with ``all_gather_object`` after each check).
    """
    cases = cases if cases is not None else default_cases()
    wanted = set(CHECK_NAMES if only is None else only)
    unknown = wanted - set(CHECK_NAMES)
    if unknown:
        raise ArgumentError(f"run_conformance: unknown checks {sorted(unknown)}; known: {list(CHECK_NAMES)}")
    results: dict[str, str | None] = {}

    def outcome(runs: list[Callable[[], None]]) -> str | None:
        mine: list[str] = []
        for run in runs:  # every check finishes its communication before raising, so go on after a failure
            try:
                run()
            except Exception as exc:  # a failed check must not stop the suite; it is reported
                mine.append(
                    str(exc) if isinstance(exc, ConformanceFailure) else f"{type(exc).__name__}: {exc}"
                )
        text = "; ".join(mine)
        text = text if len(text) <= 1500 else text[:1500] + f" ... ({len(text)} characters)"
        everyone = backend.all_gather_object(text if mine else None)
        texts = [f"rank {r}: {t}" for r, t in enumerate(everyone) if t is not None]
        return " | ".join(texts) if texts else None

    for name, check in _CASE_CHECKS:
        if name in wanted:
            results[name] = outcome([partial(check, backend, case) for case in cases.collectives])
    for name, scheck in _SIZES_CHECKS:
        if name in wanted:
            results[name] = outcome([partial(scheck, backend, case) for case in cases.sizes])
    for name, pcheck in _PLAIN_CHECKS:
        if name in wanted:
            results[name] = outcome([partial(pcheck, backend)])
    return results
