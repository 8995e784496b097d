"""How ``dtlab train`` builds the model: ``model.init`` (on the meta device or plainly), the host memory
that construction peaks at on a rank, and ``model.pretrained`` loaded into the wrapped model.

``meta`` (the default where the strategy shards the model: ZeRO-3, FSDP, tensor, pipeline, hybrid): the
module is built under ``torch.device("meta")`` and the strategy, given ``init_seed=train.seed``,
materializes and initializes only this rank's part, one module whole at a time: the peak is the rank's
share plus the largest module's own tensors. ``plain``: the module is built whole on every rank under
``seeded_init(train.seed)`` and then wrapped: the peak is at least the whole model. Both give the same
values for modules initialized by ``reset_parameters()`` (``docs/big_models.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dtlab.config import TrainConfig
from dtlab.core.plan import RunPlan
from dtlab.errors import ConfigError
from dtlab.models.base import ModelStrategy

__all__ = ["Construction", "largest_module_bytes", "load_pretrained_weights", "model_init", "tensor_bytes"]

#: the data-parallel strategies that shard parameters (with a mesh, every strategy builds on meta)
_SHARDING = ("zero3", "fsdp")


def model_init(config: TrainConfig, plan: RunPlan) -> str:
    """``"meta"`` or ``"plain"``: ``model.init``, or the default for ``plan``; meta refused where every
    rank holds the whole model anyway (DDP, ZeRO-1/2 without tensor or pipeline parallelism)."""
    shards = plan.model_parallel or plan.data_parallel in _SHARDING
    chosen = config.model.init
    if chosen is None:
        return "meta" if shards else "plain"
    if chosen == "meta" and not shards:
        raise ConfigError(
            f"model.init=meta builds the model on the meta device so that each rank materializes only its "
            f"part, but strategy.model={plan.data_parallel} without parallel.tp/parallel.pp keeps the whole "
            "model on every rank; use model.init=plain (its default), strategy.model=zero3 or fsdp, or "
            "tensor or pipeline parallelism (parallel.tp, parallel.pp)"
        )
    return chosen


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of ``tensors`` (shapes only: works on the meta device), each counted once."""
    seen: dict[int, torch.Tensor] = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in seen.values())


def largest_module_bytes(module: nn.Module) -> int:
    """The bytes of the largest single module's own parameters and buffers (what meta construction
    makes whole at one time)."""
    sizes = [
        tensor_bytes([*m.parameters(recurse=False), *m.buffers(recurse=False)]) for m in module.modules()
    ]
    return max(sizes, default=0)


@dataclass(frozen=True)
class Construction:
    """How the model was built on this rank and the host memory that took at its peak."""

    init: str  #: "meta" or "plain"
    whole_bytes: int  #: the whole model's parameters and buffers
    share_bytes: int  #: the parameters this rank holds once wrapped (``memory_report()["parameters"]``)
    largest_module_bytes: int  #: the largest module's own tensors (meta: made whole one at a time)

    @property
    def peak_bytes(self) -> int:
        """meta: this rank's share plus the largest module; plain: the whole model (at least)."""
        if self.init == "meta":
            return self.share_bytes + self.largest_module_bytes
        return self.whole_bytes

    def describe(self) -> str:
        if self.init == "meta":
            return (
                f"built on meta: peak {_size(self.peak_bytes)} host per rank (its share "
                f"{_size(self.share_bytes)} + largest module {_size(self.largest_module_bytes)})"
            )
        return f"built whole: peak >= {_size(self.whole_bytes)} host per rank (the whole model)"


def _size(n: int) -> str:
    """``1.8 MiB``; below 0.1 MiB in KiB, below 0.1 KiB in bytes (a small model is not ``0.0 MiB``)."""
    if n >= 0.1 * 2**20:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / 2**10:,.1f} KiB" if n >= 0.1 * 2**10 else f"{n} B"


def load_pretrained_weights(config: TrainConfig, model: ModelStrategy) -> None:
    """``model.pretrained`` into the wrapped model (collective), every key matching."""
    path = config.model.pretrained
    if path is None:
        return
    from dtlab.checkpoint import load_pretrained

    if not Path(path).exists():
        raise ConfigError(
            f"model.pretrained={path!r} does not exist; give a .safetensors file, a folder holding "
            "model.safetensors or model.safetensors.index.json (save_pretrained's output), or the file "
            "dtlab consolidate wrote"
        )
    load_pretrained(model, path)
