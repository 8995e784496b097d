"""RNG states as tensors (stored in each rank's ``state_rank*.safetensors``; nothing is pickled)."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


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
