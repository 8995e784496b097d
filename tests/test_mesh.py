"""``Mesh`` in memory: the layout (coordinates and group ranks of every rank), -1, absent axes, and
every invalid size with its message. Engines run ``split``/``Mesh`` in the conformance suite."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from dtlab.backends import CommunicationBackend, InMemoryWorld, Mesh
from dtlab.errors import ArgumentError
from dtlab.testing import run_world


def _layout(b: CommunicationBackend, sizes: dict[str, int]) -> dict[str, Any]:
    mesh = Mesh(b, sizes)
    combos = [
        ("pp",),
        ("dp",),
        ("tp",),
        ("dp", "tp"),
        ("pp", "tp"),
        ("pp", "dp"),
        ("pp", "dp", "tp"),
        ("cp",),
    ]
    out: dict[str, Any] = {"coords": mesh.coordinates, "shape": mesh.shape, "names": mesh.axis_names}
    for axes in combos:
        g = mesh[axes]
        t = torch.tensor([float(b.rank)])
        g.all_reduce(t)  # the group really holds the ranks it says
        out[".".join(axes)] = (g.rank, g.world_size, mesh.ranks(axes), t.item())
    out["calls"] = b.stats.calls
    return out


def test_layout_of_pp2_dp2_tp2_on_8_ranks() -> None:
    results = run_world(8, _layout, {"pp": 2, "dp": 2, "tp": 2}, timeout=30)
    for r, res in enumerate(results):
        pp, dp, tp = r // 4, (r // 2) % 2, r % 2
        assert res["names"] == ("pp", "dp", "tp")
        assert res["shape"] == {"pp": 2, "dp": 2, "tp": 2}
        assert res["coords"] == {"pp": pp, "dp": dp, "tp": tp}
        want = {
            "pp": [dp * 2 + tp, 4 + dp * 2 + tp],
            "dp": [pp * 4 + tp, pp * 4 + 2 + tp],
            "tp": [pp * 4 + dp * 2, pp * 4 + dp * 2 + 1],
            "dp.tp": [pp * 4 + i for i in range(4)],
            "pp.tp": [dp * 2, dp * 2 + 1, 4 + dp * 2, 5 + dp * 2],
            "pp.dp": [tp, 2 + tp, 4 + tp, 6 + tp],
            "pp.dp.tp": list(range(8)),
            "cp": [r],
        }
        for key, ranks in want.items():
            rank, size, got_ranks, total = res[key]
            assert got_ranks == ranks, (r, key)
            assert (rank, size) == (ranks.index(r), len(ranks)), (r, key)
            assert total == sum(ranks), (r, key)
        assert res["calls"] == 8  # the 8 all_reduces above; making the mesh's groups is not counted


def test_minus_one_and_absent_axes() -> None:
    def body(b: CommunicationBackend) -> tuple[Any, ...]:
        mesh = Mesh(b, {"dp": -1, "tp": 2})
        return (
            mesh.shape,
            mesh.size("dp"),
            mesh.size("pp"),
            mesh.size(("dp", "tp")),
            mesh.coordinate("pp"),
            "pp" in mesh,
            "tp" in mesh,
            mesh["pp", "tp"].world_size,  # absent axes have size 1: the same group as mesh["tp"]
            mesh["pp", "tp"] is mesh["tp"],
            mesh["dp", "tp"] is b,  # all axes: the backend itself
            mesh.rank_at({"tp": 0}),
        )

    for r, res in enumerate(run_world(6, body, timeout=30)):
        assert res == ({"dp": 3, "tp": 2}, 3, 1, 6, 0, False, True, 2, True, True, r - r % 2)


@pytest.mark.parametrize(
    "sizes, fragments",
    [
        ({"pp": 2, "dp": 2, "tp": 3}, ["'pp': 2", "'dp': 2", "'tp': 3", "product 12", "world size 8"]),
        ({"dp": 0, "tp": 8}, ["'dp': 0", "'tp': 8", "8 ranks", "dp=0", "positive"]),
        ({"dp": 2.0, "tp": 4}, ["'dp': 2.0", "dp=2.0", "8 ranks"]),
        ({"dp": True, "tp": 8}, ["dp=True"]),
        ({"dp": -1, "tp": -1}, ["'dp': -1", "'tp': -1", "only one axis", "8 ranks"]),
        ({"dp": -1, "tp": 3}, ["'tp': 3", "multiple", "world size 8", "other sizes, 3"]),
        ({"dp": -2, "tp": 2}, ["dp=-2"]),
        ({}, ["at least one axis"]),
        ({"": 8}, ["non-empty strings"]),
        ([("dp", 2), ("dp", 4)], ["unique", "['dp']"]),
    ],
)
def test_invalid_sizes_are_named_before_any_group_is_made(sizes: Any, fragments: list[str]) -> None:
    backend = InMemoryWorld(8, timeout=1).backend(0)  # no other rank runs: any communication would hang
    with pytest.raises(ArgumentError) as info:
        Mesh(backend, sizes)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_bad_axis_lookups() -> None:
    def body(b: CommunicationBackend) -> list[str]:
        mesh = Mesh(b, {"dp": 2, "tp": 2})
        errors = []
        for call in (
            lambda: mesh["tp", "dp"],
            lambda: mesh["tp", "tp"],
            lambda: mesh[()],
            lambda: mesh.rank_at({"pp": 0}),
            lambda: mesh.rank_at({"tp": 2}),
        ):
            try:
                call()
            except ArgumentError as exc:
                errors.append(str(exc))
        return errors

    errors = run_world(4, body, timeout=30)[0]
    assert len(errors) == 5
    assert re.search(r"outermost first.*\('dp', 'tp'\)", errors[0])
    assert "distinct" in errors[1] and "pp" in errors[3] and "tp=2" in errors[4]


def test_groups_of_groups_and_counters_feed_the_world() -> None:
    def body(b: CommunicationBackend) -> tuple[int, int, int]:
        mesh = Mesh(b, {"dp": 2, "tp": 2})
        b.stats.reset()
        mesh["tp"].all_reduce(torch.ones(8))
        inner = Mesh(mesh["dp", "tp"], {"a": 2, "b": 2})  # a mesh over a group
        inner["b"].all_reduce(torch.ones(8))
        s = b.stats["all_reduce"]
        return s.calls, s.bytes_sent, inner.ranks("a")[0]

    for r, (calls, sent, first) in enumerate(run_world(4, body, timeout=30)):
        assert (calls, sent, first) == (2, 2 * 32, r % 2)


def test_sizes_is_a_deprecated_spelling_of_shape() -> None:
    def body(b: CommunicationBackend) -> tuple[dict[str, int], dict[str, int]]:
        mesh = Mesh(b, {"dp": -1, "tp": 1})
        with pytest.warns(DeprecationWarning, match=r"Mesh\.shape"):  # one rank: warnings are per process
            sizes = mesh.sizes
        return sizes, mesh.shape

    for sizes, shape in run_world(1, body, timeout=30):
        assert sizes == shape == {"dp": 1, "tp": 1}
