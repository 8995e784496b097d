"""Conformance checks of ``split`` and :class:`~dtlab.backends.mesh.Mesh`: several colors, ranks left
out, key order, overlapping groups used alternately, point-to-point inside a group, byte counters
of groups feeding their parent's. Re-exported by :mod:`dtlab.testing.conformance`."""

from __future__ import annotations

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.backends.mesh import Mesh
from dtlab.errors import ArgumentError
from dtlab.testing._checking import Problems

__all__ = ["check_mesh", "check_split", "mesh_sizes"]


def _ring(group: CommunicationBackend, value: float, tag: int) -> float:
    """Send ``value`` to the next group rank, return what the previous one sent (blocking + non-)."""
    p, me = group.world_size, group.rank
    out = torch.full((3,), value, dtype=torch.float64, device=group.device)
    got = torch.zeros(3, dtype=torch.float64, device=group.device)
    work = group.isend(out, (me + 1) % p, tag=tag)
    group.recv(got, (me - 1) % p, tag=tag)
    work.wait()
    return float(got[0].item()) if bool((got == got[0]).all()) else float("nan")


def check_split(backend: CommunicationBackend) -> None:
    """``split`` into three colors with reversed keys, with rank 0 left out, and bad arguments."""
    p, me, dev = backend.world_size, backend.rank, backend.device
    pr = Problems("split", me)
    for bad in ((-1, 0), ("a", 0), (True, 0), (0, 1.5), (2**31, 0)):
        try:
            backend.split(*bad)
        except ArgumentError:
            pass
        else:
            pr.add(f"split{bad} did not raise ArgumentError")
    # three colors (rank % 3), numbered by key = -rank: each group in descending world rank
    color = me % 3
    group = backend.split(color, -me)
    members = sorted((r for r in range(p) if r % 3 == color), reverse=True)
    if group is None:
        pr.add(f"split({color}, {-me}) returned None")
    else:
        pr.expect(
            (group.rank, group.world_size) == (members.index(me), len(members)),
            f"split({color}, key={-me}): rank {group.rank} of {group.world_size}, expected "
            f"{members.index(me)} of {len(members)} (members {members})",
        )
        order = group.all_gather_object(me)
        pr.expect(order == members, f"color {color}: group ranks hold world ranks {order}, want {members}")
        t = torch.full((color + 1,), float(me), device=dev)
        group.all_reduce(t, ReduceOp.SUM if color != 1 else ReduceOp.MAX)
        want = float(sum(members) if color != 1 else max(members))
        pr.expect(
            t.tolist() == [want] * (color + 1), f"color {color}: all_reduce gave {t.tolist()}, want {want}"
        )
        if group.world_size > 1:  # point-to-point inside the group, numbered by group rank
            prev = members[(group.rank - 1) % len(members)]
            got = _ring(group, float(me), tag=color + 3)
            pr.expect(got == prev, f"color {color}: ring in the group received {got}, want {prev}")
        # a group's counters feed its parent's
        backend_before = backend.stats["all_reduce"]
        group.stats.reset()
        group.all_reduce(torch.ones(6, device=dev))
        q = group.world_size
        moved = 2 * (q - 1) * 24 // q
        got_group = group.stats["all_reduce"]
        got_parent = backend.stats["all_reduce"]
        pr.expect(
            (got_group.calls, got_group.bytes_sent) == (1, moved)
            and (got_parent.calls - backend_before.calls, got_parent.bytes_sent - backend_before.bytes_sent)
            == (1, moved),
            f"a split group's all_reduce counted as {got_group} (group) and "
            f"{got_parent.calls - backend_before.calls} calls / "
            f"{got_parent.bytes_sent - backend_before.bytes_sent} bytes (parent), want 1 call, {moved} bytes",
        )
    # rank 0 takes no part; the rest form one group ordered by rank
    rest = backend.split(None if me == 0 else 7, 0)
    pr.expect((rest is None) == (me == 0), f"split(None) on rank {me} returned {rest!r}")
    if rest is not None:
        pr.expect(rest.rank == me - 1 and rest.world_size == p - 1, f"the rest group: {rest!r}")
        t = torch.ones(1, device=dev)
        rest.all_reduce(t)
        pr.expect(t.item() == p - 1, f"the rest group's all_reduce gave {t.item()}, want {p - 1}")
    backend.barrier()
    pr.raise_if_any()


def mesh_sizes(world_size: int) -> dict[str, int]:
    """The mesh :func:`check_mesh` builds: pp x dp x tp with pp = tp = 2 where the world allows."""
    if world_size % 4 == 0 and world_size >= 8:
        return {"pp": 2, "dp": -1, "tp": 2}
    if world_size % 2 == 0:
        return {"dp": -1, "tp": 2}
    return {"dp": -1}


def check_mesh(backend: CommunicationBackend) -> None:
    """A :class:`Mesh`: every axis group and ``mesh["dp", "tp"]`` hold the ranks the layout says;
    dp and tp (overlapping groups) used alternately with different ops and shapes; p2p along tp."""
    me, dev = backend.rank, backend.device
    pr = Problems("mesh", me)
    mesh = Mesh(backend, mesh_sizes(backend.world_size))
    for axes in [(a,) for a in mesh.axis_names] + [("dp", "tp"), ("cp",)]:
        group, ranks = mesh[axes], mesh.ranks(axes)
        pr.expect(
            group.world_size == len(ranks) == mesh.size(axes) and group.rank == mesh.coordinate(axes),
            f"mesh[{axes}]: rank {group.rank} of {group.world_size}, layout says {mesh.coordinate(axes)} "
            f"of {mesh.size(axes)} (ranks {ranks})",
        )
        pr.expect(
            ranks[group.rank] == me, f"mesh.ranks({axes}) = {ranks} does not hold rank {me} at its place"
        )
        got = group.all_gather_object(me)
        pr.expect(got == ranks, f"mesh[{axes}] gathers world ranks {got}, mesh.ranks says {ranks}")
    dp, tp = mesh["dp"], mesh["tp"]
    for k in range(3):  # alternate between the overlapping groups: crosstalk shows as a wrong value
        a = torch.full((2,), float(me + k), dtype=torch.float64, device=dev)
        dp.all_reduce(a)
        b = torch.full((3,), float(me * k), device=dev)
        tp.all_reduce(b, ReduceOp.MAX)
        want_a = float(sum(r + k for r in mesh.ranks("dp")))
        want_b = float(max(r * k for r in mesh.ranks("tp")))
        pr.expect(a.tolist() == [want_a] * 2, f"round {k}: dp all_reduce gave {a.tolist()}, want {want_a}")
        pr.expect(b.tolist() == [want_b] * 3, f"round {k}: tp all_reduce gave {b.tolist()}, want {want_b}")
    if tp.world_size > 1:
        prev = mesh.ranks("tp")[(tp.rank - 1) % tp.world_size]
        got_prev = _ring(tp, float(me), tag=11)
        pr.expect(got_prev == prev, f"ring along tp received {got_prev}, want {prev}")
    flat = mesh["dp", "tp"]
    v = torch.tensor([float(me)], device=dev)
    flat.broadcast(v, flat.world_size - 1)
    want_v = float(mesh.ranks(("dp", "tp"))[-1])
    pr.expect(
        v.item() == want_v, f"mesh['dp', 'tp'] broadcast from its last rank gave {v.item()}, want {want_v}"
    )
    backend.barrier()
    mesh.close()
    pr.raise_if_any()
