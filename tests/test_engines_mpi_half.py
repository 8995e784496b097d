"""MPI's float16/bfloat16 sums (``backends/_mpi_half.py``): bitwise the float32 sum in rank order
rounded once, half-precision bytes on the wire. ``half_sums`` runs inside the MPI worlds of
test_engines_conformance.py (one spawned world per engine and size); its local step is tested here."""

from __future__ import annotations

from typing import Any

import torch

from dtlab.backends import CommunicationBackend, ReduceOp


class _CountingComm:
    """A real mpi4py communicator that also logs the collectives called on it with the bytes this
    rank's data contributes (Alltoallv: what goes to the others; Allgather: its block to P-1 ranks;
    Bcast: the root's buffer to P-1 ranks; others -1); a duplicate logs with ``dup:`` in front. The
    wire bytes of an MPIBackend's half-precision sums, taken at the MPI calls, not from its counters."""

    def __init__(self, comm: Any, log: list[tuple[str, int]], tag: str = "") -> None:
        self._comm, self.log, self._tag = comm, log, tag

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if not callable(attr) or not name[:1].isupper() or name.startswith(("Get_", "Free")):
            return attr
        plain = name[1].upper() + name[2:] if name[0] == "I" and name[1].islower() else name  # Ibcast

        def call(*args: Any, **kw: Any) -> Any:
            me, p = self._comm.Get_rank(), self._comm.Get_size()
            moved = -1
            if plain == "Alltoallv":
                moved = sum(args[0][1][0]) - args[0][1][0][me]
            elif plain == "Allgather":
                moved = len(args[1][0]) // p * (p - 1)
            elif plain == "Bcast":
                moved = len(args[0][0]) * (p - 1) if args[1] == me else 0
            self.log.append((self._tag + plain, moved))
            out = attr(*args, **kw)
            if plain == "Dup":
                new, request = (out, None) if name == "Dup" else out
                dup = _CountingComm(new, self.log, "dup:")
                return dup if request is None else (dup, request)
            return out

        return call


def _half_reference(inputs: list[torch.Tensor], avg: bool) -> torch.Tensor:
    """Every rank's input added in float32 in rank order, divided for AVG, rounded once."""
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    return (acc / len(inputs) if avg else acc).to(inputs[0].dtype)


def half_sums(b: CommunicationBackend, timeout: float | None) -> None:
    """float16/bfloat16 SUM/AVG on MPI: bitwise the float32 sum in rank order rounded once (sizes not
    divisible by P, below P), identical on every rank, non-blocking ones waited in
    reverse order; on the wire half-precision bytes: all-to-all plus all-gather, no MPI reduction."""
    from dtlab.backends import MPIBackend

    log: list[tuple[str, int]] = []
    h = MPIBackend(_CountingComm(b.comm.Dup(), log), timeout=timeout)  # type: ignore[attr-defined]
    p, me = h.world_size, h.rank

    def inputs(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
        gens = [torch.Generator().manual_seed(seed + r) for r in range(p)]
        return [
            (torch.randn(n, generator=g) * 2.0 ** torch.randint(-6, 6, (n,), generator=g)).to(dtype)
            for g in gens
        ]

    for dtype in (torch.float16, torch.bfloat16):
        for n in (1, 2 * p + 1, 9_999):
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                xs = inputs(n, dtype, 7 * n)
                t = xs[me].clone()
                log.clear()
                h.stats.reset()
                h.all_reduce(t, op)
                want = _half_reference(xs, op is ReduceOp.AVG)
                if not torch.equal(t, want):
                    bad = int((t != want).sum())
                    raise AssertionError(f"all_reduce({dtype}, {op.name}, n={n}): {bad} elements differ")
                q, left = divmod(n, p)
                chunk = q + (left if me == p - 1 else 0)  # the last rank also reduces the left-over
                halves = [x for x in log if x[0] in ("Alltoallv", "dup:Allgather", "dup:Bcast")]
                wire = sum(c for _, c in halves)
                others = [x for x in log if x not in halves and x[0] not in ("Dup", "Allgather")]
                if others or wire != 2 * (n - chunk + (p - 1) * chunk):  # "Allgather": checked mode's
                    raise AssertionError(f"all_reduce({dtype}, n={n}) on the wire: {log}")
                # the counters' ring formula 2(P-1)/P * 2n bytes: exact over all ranks, off by at most
                # 2 (P-2)(P-1) bytes on one rank (the last rank's chunk is up to P-1 elements longer)
                counted = h.stats["all_reduce"].bytes_sent
                if abs(counted - wire) > 2 * (p - 2) * (p - 1) or (p == 2 and counted != wire):
                    raise AssertionError(f"all_reduce({dtype}, n={n}) counted {counted} bytes, sent {wire}")
                if sum(h.all_gather_object(wire)) != 4 * (p - 1) * n:
                    raise AssertionError(
                        f"all_reduce({dtype}, n={n}): the ranks sent {h.all_gather_object(wire)}"
                    )
        # two non-blocking all-reduces and a reduce-scatter, waited in reverse order; an aliased one
        xs, ys = inputs(1001, dtype, 1), inputs(p * 333, dtype, 2)
        a, c = xs[me].clone(), ys[me].clone()
        out = torch.empty(333, dtype=dtype)
        works = [h.iall_reduce(a), h.ireduce_scatter(out, ys[me].clone()), h.iall_reduce(c, ReduceOp.AVG)]
        for w in reversed(works):
            w.wait()
        rs = _half_reference(ys, False)[me * 333 : (me + 1) * 333]
        got = [torch.equal(a, _half_reference(xs, False)), torch.equal(c, _half_reference(ys, True))]
        if not all(got) or not torch.equal(out, rs):
            raise AssertionError(f"non-blocking {dtype}: {got}, reduce_scatter {torch.equal(out, rs)}")
        log.clear()
        buf = ys[me].clone()
        h.reduce_scatter(buf[me * 333 : (me + 1) * 333], buf, ReduceOp.SUM)
        sent = [x for x in log if x[0] != "Allgather"]  # checked mode's agreement aside
        if not torch.equal(buf[me * 333 : (me + 1) * 333], rs) or sent != [("Alltoallv", 2 * 333 * (p - 1))]:
            raise AssertionError(f"aliased reduce_scatter({dtype}): {log}")
    h.close()


def test_half_sum_rows_adds_in_float32_in_order_and_rounds_once() -> None:
    """The local step of MPI's half-precision sums over several CPU blocks (``_BLOCK`` elements each),
    the output being one of the rows, bitwise equal to the reference; a per-addition rounding fails."""
    from dtlab.backends._mpi_half import _BLOCK, sum_rows

    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float16, torch.bfloat16):
        rows = [(torch.randn(2 * _BLOCK + 3, generator=g) * 64).to(dtype) for _ in range(3)]
        for divide in (1, 3):
            want = _half_reference(rows, divide == 3)
            out = rows[1].clone()
            sum_rows([rows[0], out, rows[2]], out, divide)
            assert torch.equal(out, want), (dtype, divide)
        stepwise = (rows[0] + rows[1]) + rows[2]  # rounded after each addition: differs somewhere
        assert not torch.equal(stepwise, _half_reference(rows, False)), dtype
