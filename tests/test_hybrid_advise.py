"""``dtlab advise`` against the hybrid strategy as ``dtlab train`` builds it: on every mesh shape of 4
in-memory ranks (pp x dp x tp), bytes per rank per axis and memory per rank (state and activations) as
predicted, to the byte (the rows of ``dtlab bench``'s 3-D table, ``dtlab.benchmarks.mesh``; its step
times are not checked here)."""

from __future__ import annotations

import argparse

import pytest

from dtlab.benchmarks.mesh import mesh_shapes, run


@pytest.mark.parametrize("checkpointing", [False, True])
def test_every_mesh_shape_is_predicted_to_the_byte(checkpointing: bool) -> None:
    """With checkpointing: per stage under a pipeline, per block without one (with tp, the
    recomputed all-reduces counted)."""
    args = argparse.Namespace(
        engines="inmemory",
        ranks=4,
        strategies="ddp,zero2,fsdp",
        d_model=16,
        layers=4,
        heads=2,
        seq=8,
        batch=8,
        steps=1,
        warmup=1,
        rounds=1,
        checkpointing=checkpointing,
    )
    rows = run(args)
    assert {(r["pp"], r["dp"], r["tp"]) for r in rows} == set(mesh_shapes(4, heads=2, layers=4))
    assert len(mesh_shapes(4, heads=2, layers=4)) == 5  # tp <= 2 (heads), pp dividing the layers
    for r in rows:
        where = f"{r['mesh']} {r['strategy']}"
        # FSDP's checkpointed pipeline stages too: they recompute (and rerun their tp all-reduces)
        assert r["sent"] == r["predicted_sent"], where
        assert r["state"] == r["predicted_state"], where
        if r["activations"] is not None:  # not measurable under FSDP without a pipeline
            assert r["activations"] == r["predicted_activations"], where
    assert sum(r["activations"] is not None for r in rows) >= 12
