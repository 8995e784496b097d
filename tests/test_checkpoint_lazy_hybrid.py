"""A hybrid model's resume materialises its share: FSDP x tp (dp2 x tp2), ZeRO-3 x pp (pp2 x dp2) and
ZeRO-1 x pp x tp (pp2 x tp2) checkpoints loaded on the same mesh, each rank reading about a quarter of
the model and AdamW state (its flat shards or its stage's tp pieces, plus small replicated tensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.testing import run_world

CASES = [
    ({"dp": 2, "tp": 2}, "fsdp", {}),
    ({"pp": 2, "dp": 2}, "zero3", {"micro_batches": 2}),
    ({"pp": 2, "tp": 2}, "zero1", {"micro_batches": 2}),
]


def _build(backend: CommunicationBackend, shape: dict[str, int], dp: str, pipe: dict[str, Any]) -> Any:
    model = hybrid_model(backend, shape, dp, **pipe)
    return model, OPTIMIZER_OF[dp](model, torch.optim.AdamW, lr=0.01)


def _save(
    backend: CommunicationBackend, root: str, shape: dict[str, int], dp: str, pipe: dict[str, Any]
) -> Any:
    model, opt = _build(backend, shape, dp, pipe)
    x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(3))
    x = x.chunk(model.mesh.size("dp"))[model.mesh.coordinate("dp")]
    model.train_step((x, x), model.cross_entropy)
    opt.step()
    save_checkpoint(
        root, 1, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {"r": torch.zeros(2)}, {}
    )
    return model.full_state_dict()


def _load(
    backend: CommunicationBackend, root: str, shape: dict[str, int], dp: str, pipe: dict[str, Any]
) -> Any:
    model, opt = _build(backend, shape, dp, pipe)
    ckpt = read_checkpoint(root, verify_all=False)
    model.load_sharded_state_dict(ckpt.model)
    opt.load_sharded_state_dict(ckpt.optim)
    return ckpt.reads.tensor_bytes, model.full_state_dict()


@pytest.mark.parametrize(
    ("shape", "dp", "pipe"), CASES, ids=["fsdp_dp2_tp2", "zero3_pp2_dp2", "zero1_pp2_tp2"]
)
def test_a_hybrid_rank_reads_about_a_quarter(
    tmp_path: Path, shape: dict[str, int], dp: str, pipe: dict[str, Any]
) -> None:
    """Before: every rank held all of it (510,976 B for fsdp_dp2_tp2). Now 128,448 B per rank."""
    saved = run_world(4, _save, str(tmp_path), shape, dp, pipe)[0]
    meta = json.loads((tmp_path / "step_00000001" / "meta.json").read_text())
    total = sum(
        (e["end"] - e["start"]) * 4
        for r in meta["ranks"]
        for k in ("model", "optim")
        for e in r[k]["entries"].values()
    )
    for read, full in run_world(4, _load, str(tmp_path), shape, dp, pipe):
        assert all(torch.equal(full[k], saved[k]) for k in saved)
        assert total / 4 * 0.95 < read < total / 4 * 1.05, (read, total)


def test_the_resume_memory_benchmark_runs(tmp_path: Path, capsys: Any) -> None:
    """``python -m dtlab.benchmarks.resume_memory``'s measurement, small: 2 ranks read all the data once."""
    from dtlab.benchmarks import resume_memory

    run_world(4, resume_memory._save, str(tmp_path), 64, 2)
    resume_memory._child(str(tmp_path), 2, 64, 2)
    peak, read = capsys.readouterr().out.split()
    assert int(peak) >= 0 and int(read) == 3 * 2 * 64 * 64 * 4  # the weights and two AdamW moments
