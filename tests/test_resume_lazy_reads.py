"""The Trainer's resume reads what each rank keeps: rank 0 chooses the checkpoint and verifies every
file by streaming it (holding no tensor), each other rank verifies and reads only the files holding its
own part, and a file changed after rank 0's check is refused on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.errors import RankFailedError
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import Trainer, run_training
from dtlab.trainers.resume import choose_checkpoint, restore_agreed

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=2",
    "optimizer.warmup_steps=1",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.run_dir=null",
    "strategy.model=fsdp",
]


def _resume(backend: CommunicationBackend, config: TrainConfig, fresh: TrainConfig) -> dict[str, Any]:
    chosen = choose_checkpoint(config, backend)
    ckpt = chosen.checkpoint
    assert ckpt is not None
    before = (ckpt.reads.bytes_read, ckpt.reads.tensor_bytes, list(ckpt.reads.verified))
    trainer = Trainer(fresh, backend)
    restore_agreed(trainer, ckpt)
    held = sum(
        t.numel() * t.element_size()
        for s in (trainer.model.sharded_state_dict(), trainer.optimizer.sharded_state_dict())
        for t in s.tensors.values()
    )
    return {
        "before": before,
        "verified": list(ckpt.reads.verified),
        "tensor_bytes": ckpt.reads.tensor_bytes,
        "read": ckpt.reads.bytes_read,
        "held": held,
        "step": trainer.step,
    }


def test_resume_reads_on_each_rank_only_its_own_files(tmp_path: Path) -> None:
    """FSDP 4 -> 4. Before: every rank read every file twice (hash, then whole) and held all 12 files'
    tensors. Now: rank 0 streams all 12 once holding none, then reads its own part; rank r != 0 reads
    only model_r, optim_r, state_r (each streamed once) and its part of them."""
    ck = tmp_path / "ck"
    run_training(
        load_config(overrides=[*TINY, "train.steps=2", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    )
    step = ck / "step_00000002"
    sizes = {n: i["bytes"] for n, i in json.loads((step / "meta.json").read_text())["files"].items()}
    resume = load_config(overrides=[*TINY, "train.steps=3", f"checkpoint.dir={ck}", "checkpoint.resume=true"])
    fresh = load_config(overrides=[*TINY, "train.steps=3"])
    got = run_world(4, _resume, resume, fresh)
    assert got[0]["before"] == (sum(sizes.values()), 0, sorted(sizes, key=list(sizes).index))
    for r, g in enumerate(got):
        own = {f"{kind}_rank{r:05d}.safetensors" for kind in ("model", "optim", "state")}
        assert g["step"] == 2
        if r:
            assert g["before"] == (0, 0, [])
            assert set(g["verified"]) == own and len(g["verified"]) == 3, g["verified"]
        else:
            assert g["verified"] == g["before"][2]  # nothing hashed twice
        model_optim = g["tensor_bytes"] - sizes_of_rng(step, r)
        assert model_optim == g["held"], (r, g)
        hashed = sum(sizes[f] for f in g["verified"])
        assert g["read"] == hashed + g["tensor_bytes"], (r, g)


def sizes_of_rng(step: Path, rank: int) -> int:
    """Bytes of tensor data in rank ``rank``'s RNG file (its header's data)."""
    raw = (step / f"state_rank{rank:05d}.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return len(raw) - 8 - n


def test_a_file_changed_after_rank_0_verified_it_is_refused_on_every_rank(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run_training(
        load_config(overrides=[*TINY, "train.steps=2", f"checkpoint.dir={ck}", "checkpoint.every=2"])
    )
    resume = load_config(overrides=[*TINY, "train.steps=3", f"checkpoint.dir={ck}", "checkpoint.resume=true"])
    fresh = load_config(overrides=[*TINY, "train.steps=3"])
    target = ck / "step_00000002" / "optim_rank00002.safetensors"

    def tamper_then_resume(backend: CommunicationBackend) -> None:
        chosen = choose_checkpoint(resume, backend)
        assert chosen.checkpoint is not None
        if backend.rank == 0:
            raw = bytearray(target.read_bytes())
            raw[-1] ^= 1
            target.write_bytes(bytes(raw))
        backend.barrier()
        restore_agreed(Trainer(fresh, backend), chosen.checkpoint)

    with pytest.raises(RankFailedError) as info:
        run_world(4, tamper_then_resume, timeout=120)
    said = str(info.value)
    assert "failed on rank [2]" in said and "optim_rank00002.safetensors is corrupted" in said, said
