"""``dtlab advise`` against the hybrid strategy as ``dtlab train`` builds it: on every mesh shape of 4
in-memory ranks (pp x dp x tp), bytes per rank per axis and memory per rank (state and activations) as
predicted, to the byte (the rows of ``dtlab bench``'s 3-D table, ``dtlab.benchmarks.mesh``; its step
times are not checked here)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dtlab.benchmarks._mesh_measure import measure
from dtlab.benchmarks._mesh_report import row
from dtlab.benchmarks.mesh import mesh_shapes, run
from dtlab.config import load_config
from dtlab.testing import run_world


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


def test_find_unused_parameters_is_predicted_to_the_byte() -> None:
    """``strategy.find_unused_parameters=true``: every synchronization all-reduces which parameters each
    rank used (a float64 per trainable parameter; ZeRO-3/FSDP also compare the units each rank gathered,
    two float64), and a pipelined step sends one float32 over dp (whether every replica's loss had no
    graph) in place of its all-reduce of every replica's unused counts:
    the bytes per rank per axis as the backends count them, on every mesh shape of 4 in-memory ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per rank, as the mesh benchmark runs them
    try:
        for shape in mesh_shapes(4, heads=2, layers=4):
            pp, _, tp = shape
            for strategy in ("ddp", "zero2", "fsdp"):
                sets = [
                    "backend.name=inmemory",
                    "backend.world_size=4",
                    "model.d_model=16",
                    "model.n_layers=4",
                    "model.n_heads=2",
                    "model.seq_len=8",
                    "data.global_batch_size=8",
                    "optimizer.name=adamw",
                    f"strategy.model={strategy}",
                    f"parallel.tp={tp}",
                    f"parallel.pp={pp}",
                    "strategy.find_unused_parameters=true",
                ]
                config = load_config(overrides=sets)
                ranks = run_world(4, measure, config, 1, 1, timeout=300)
                r = row("inmemory", shape, strategy, config, [ranks])
                assert r["sent"] == r["predicted_sent"], f"{r['mesh']} {strategy}"
    finally:
        torch.set_num_threads(threads)
