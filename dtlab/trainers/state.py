"""RNG states as tensors (stored in each rank's ``state_rank*.safetensors``; nothing is pickled) and
the Trainer's JSON state (``meta.json``)."""

from __future__ import annotations

import base64
import binascii
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtlab.config import TrainConfig
from dtlab.errors import CheckpointError
from dtlab.trainers.build import optimizer_record
from dtlab.trainers.saved_state import Resumable
from dtlab.trainers.scheduler import scheduler_state

__all__ = ["capture_rng", "restore_rng", "rng_from_json", "rng_to_json", "trainer_state"]


def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    version, internal, _gauss = random.getstate()
    out["python"] = torch.tensor([version, *internal], dtype=torch.int64)
    _name, keys, pos, _has_gauss, _cached = np.random.get_state(legacy=True)
    out["numpy"] = torch.tensor([int(pos), *[int(k) for k in keys]], dtype=torch.int64)
    return out


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
    if "python" in state:
        vals = [int(v) for v in state["python"].tolist()]
        random.setstate((vals[0], tuple(vals[1:]), None))
    if "numpy" in state:
        vals = [int(v) for v in state["numpy"].tolist()]
        np.random.set_state(("MT19937", np.array(vals[1:], dtype=np.uint32), vals[0], 0, 0.0))


_DTYPES = {"uint8": torch.uint8, "int64": torch.int64}


def rng_to_json(states: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, Any]:
    """A rank's RNG states (:func:`capture_rng`'s, an in-memory rank's own generator's) as JSON, for an
    elastic commit: each tensor's bytes in base64, tagged with the rank and world size they are of."""
    return {
        "rank": rank,
        "world_size": world_size,
        "states": {
            k: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "data": base64.b64encode(t.numpy().tobytes()).decode(),
            }
            for k, t in states.items()
        },
    }


def rng_from_json(
    saved: Any, like: dict[str, torch.Tensor], rank: int, world_size: int, where: str
) -> dict[str, torch.Tensor] | None:
    """The states :func:`rng_to_json` wrote, where they are this ``rank``'s of this ``world_size``
    (else ``None``: the run goes on with its own); each of the dtype and size of ``like``'s (the live
    states; a state ``like`` lacks is left out), else a :class:`CheckpointError`."""
    if not isinstance(saved, dict) or saved.get("rank") != rank or saved.get("world_size") != world_size:
        return None
    entries = saved.get("states")
    if not isinstance(entries, dict) or "torch_cpu" not in entries:
        raise CheckpointError(f"{where} is corrupted: rank {rank}'s RNG states lack torch_cpu")
    out: dict[str, torch.Tensor] = {}
    for k, v in entries.items():
        ref = like.get(k) if isinstance(k, str) else None
        if ref is None:  # a generator this run does not have (an in-memory rank's, under a launcher)
            continue
        dtype = _DTYPES.get(str(v.get("dtype"))) if isinstance(v, dict) else None
        data = v.get("data") if isinstance(v, dict) else None
        try:
            raw = base64.b64decode(data, validate=True) if isinstance(data, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if dtype != ref.dtype or len(raw) != ref.numel() * ref.element_size():
            raise CheckpointError(f"{where} is corrupted: its RNG state {k!r} of rank {rank} is malformed")
        out[k] = torch.frombuffer(bytearray(raw), dtype=ref.dtype).clone()
    return out


def trainer_state(
    live: Resumable, config: TrainConfig, run_id: str, resumed_from: str | None, run_dir: Path | None
) -> dict[str, Any]:
    """What ``meta.json`` holds of a Trainer: the run (``run_id``, the checkpoint it resumed from, its
    run directory), strategy, config, optimizer record, data position, step, scheduler, guard, loss
    scaler and early-stopping state (all JSON)."""
    return {
        # which run wrote this step, and from what it resumed: how a resume tells a save interrupted
        # before ``latest`` moved from another run's step directory (dtlab/checkpoint/resume.py)
        "run": {
            "id": run_id,
            "resumed_from": str(Path(resumed_from).resolve()) if resumed_from else None,
            "run_dir": str(run_dir.resolve()) if run_dir is not None else None,
        },
        "strategy": {
            "model": config.strategy.model,
            "optimizer": config.strategy.optimizer_name,
        },
        "config": config.to_dict(),
        "optimizer": optimizer_record(config),
        "data_position": live.feed.state_dict(),
        "trainer": {
            "step": live.step,
            "scheduler": scheduler_state(live.scheduler),
            "guard": live.guard.state_dict(),
            "loss_scaler": live.scaler.state_dict() if live.scaler is not None else None,
            "early_stopping": live.early.state_dict(),
        },
    }
