"""Checked mode on real engines: mismatched collective calls (element count, dtype, op, root, kind,
inside a mesh group) are a ``CollectiveMismatchError`` on every rank naming every rank's call; the
world stays in step afterwards. One spawned world of 3 processes per engine; rank 1 deviates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtlab.backends import CommunicationBackend, Mesh, ReduceOp
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError
from dtlab.testing import spawn_world


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def mismatches(b: CommunicationBackend, engine: str) -> dict[str, Any]:
    me, p = b.rank, b.world_size
    odd = me == 1  # the deviating rank
    n = 1_000_000
    cases: dict[str, Any] = {"checked": b.check_collectives}
    cases["numel"] = _outcome(lambda: b.all_reduce(torch.ones(n + 7 if odd else n)))
    f64 = torch.float64 if odd else torch.float32
    cases["dtype"] = _outcome(lambda: b.all_reduce(torch.ones(5, dtype=f64)))
    cases["op"] = _outcome(lambda: b.all_reduce(torch.ones(4), ReduceOp.MAX if odd else ReduceOp.SUM))
    cases["root"] = _outcome(lambda: b.broadcast(torch.ones(4), 1 if odd else 0))
    cases["reduce dst"] = _outcome(lambda: b.reduce(torch.ones(4), 2 if odd else 0))
    k = 3 if odd else 2
    cases["reduce_scatter"] = _outcome(lambda: b.reduce_scatter(torch.empty(k), torch.ones(k * p)))
    cases["all_gather"] = _outcome(lambda: b.all_gather(torch.empty(k * p), torch.ones(k)))
    cases["kind"] = _outcome(lambda: b.barrier() if odd else b.all_reduce(torch.ones(2)))
    mesh = Mesh(b, {"dp": -1})  # a group of every rank (split), checked like its parent
    cases["group"] = _outcome(lambda: mesh["dp"].all_gather_object(me) if odd else mesh["dp"].barrier())
    # still in step: a matching call works and counts only its own bytes (the check is not counted)
    b.stats.reset()
    t = torch.full((6,), float(me))
    b.all_reduce(t)
    s = b.stats["all_reduce"]
    cases["after"] = (t.tolist(), s.calls, s.bytes_sent)
    if engine == "gloo":  # unchecked: gloo times out on a root mismatch; the message says it may be one
        g = b.new_group([0, 1])  # each of the two broadcasts from itself: both wait for the other
        if g is not None:
            g.check_collectives = False
            cases["unchecked root"] = _outcome(lambda: g.broadcast(torch.ones(4), g.rank))
    return cases


@pytest.mark.parametrize("engine", ["gloo", "mpi"])
def test_mismatched_calls_are_named_on_every_rank(engine: str) -> None:
    per_rank = spawn_world(3, mismatches, engine, backend=engine, timeout=120, backend_timeout=8)
    calls = {
        "numel": ("all_reduce(shape=(1000000,), dtype=torch.float32, op=SUM)", "shape=(1000007,)"),
        "dtype": ("all_reduce(shape=(5,), dtype=torch.float32, op=SUM)", "dtype=torch.float64"),
        "op": ("all_reduce(shape=(4,), dtype=torch.float32, op=SUM)", "op=MAX"),
        "root": ("broadcast(shape=(4,), dtype=torch.float32, src=0)", "src=1"),
        "reduce dst": ("reduce(shape=(4,), dtype=torch.float32, op=SUM, dst=0)", "dst=2"),
        "reduce_scatter": ("reduce_scatter(output_numel=2,", "reduce_scatter(output_numel=3,"),
        "all_gather": ("all_gather(input_numel=2,", "all_gather(input_numel=3,"),
        "kind": ("all_reduce(shape=(2,)", "barrier()"),
        "group": ("barrier()", "all_gather_object()"),
    }
    for rank, cases in enumerate(per_rank):
        assert cases["checked"] is True  # spawn_world turns checked mode on
        for case, (theirs, odd) in calls.items():
            kind, text = cases[case]
            assert kind == CollectiveMismatchError.__name__, (engine, rank, case, kind, text)
            # every rank names both calls: ranks 0 and 2 called one, rank 1 the other
            assert f"ranks 0, 2: {theirs}" in text and "rank 1: " in text and odd in text, (case, text)
            assert text.startswith(f"rank {rank}:"), text
        values, calls_counted, sent = cases["after"]
        assert values == [3.0] * 6 and calls_counted == 1 and sent == 2 * 2 * 24 // 3, cases["after"]
        if engine == "gloo" and rank < 2:
            kind, text = cases["unchecked root"]
            assert kind == CollectiveTimeoutError.__name__, text
            assert (
                "different shapes, dtypes, reduce ops or roots" in text
                and "DTLAB_CHECK_COLLECTIVES=1" in text
            )


def test_checked_mode_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlab.backends import InMemoryWorld
    from dtlab.backends._checked import checks_from_env, decode, encode
    from dtlab.errors import ConfigError

    for value, want in (("1", True), ("true", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("DTLAB_CHECK_COLLECTIVES", value)
        assert checks_from_env() is want
    monkeypatch.setenv("DTLAB_CHECK_COLLECTIVES", "maybe")
    with pytest.raises(ConfigError, match="DTLAB_CHECK_COLLECTIVES='maybe'"):
        checks_from_env()
    monkeypatch.delenv("DTLAB_CHECK_COLLECTIVES")
    # the in-memory world compares every call itself: always checked, no extra exchange
    b = InMemoryWorld(1).backend(0)
    b.check_collectives = False
    assert b.check_collectives is True
    # every call round-trips through its fixed-size row; long shapes keep 9 dims and the product
    for call in (
        ("all_reduce", torch.Size([2, 3]), torch.bfloat16, ReduceOp.AVG),
        ("reduce", torch.Size([]), torch.int8, ReduceOp.MIN, 5),
        ("broadcast", torch.Size([7]), torch.bool, 3),
        ("reduce_scatter", 11, torch.float64, ReduceOp.PRODUCT),
        ("all_gather_v", torch.int32),
        ("barrier",),
    ):
        row = encode(call)
        assert len(row) == 16 and decode(row) == tuple(
            tuple(v) if isinstance(v, torch.Size) else v for v in call
        )
    long = torch.Size([2] * 12)
    assert decode(encode(("all_reduce", long, torch.float32, ReduceOp.SUM)))[1] == (2,) * 9 + (8,)
