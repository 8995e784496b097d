"""A rank's pipeline stages under the parameter names of the whole model, for a data-parallel strategy.

:class:`StageRoot` is the module the hybrid strategy's data-parallel layer wraps: its registered
submodules are the user's own modules of this rank's stages, at their paths in the whole model (so
``named_parameters()`` and ``state_dict()`` are keyed like the plain module and FSDP/ZeRO-3 hooks on
those modules fire when a stage runs them), and its ``forward(x, stage)`` runs one stage. The stages
themselves (:class:`~dtlab.models.pipeline._split.Stage`, which may hold wrapper blocks such as
``TransformerLM``'s embedding block, or :class:`~dtlab.models.pipeline._trace.TracedStage`) are kept
outside the module tree, so nothing is registered twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["StageRoot", "mirror_tree"]


def _ids(module: nn.Module) -> set[int]:
    return {id(t) for t in list(module.parameters()) + list(module.buffers())}


def mirror_tree(into: nn.Module, source: nn.Module, keep: set[int]) -> None:
    """Register in ``into`` what ``source`` holds of the tensors in ``keep`` (ids), at the same paths:
    a child whose tensors are all kept is registered itself (the real module, so its hooks fire when it
    runs); a child holding some is mirrored by an empty container, recursively; tensors owned directly
    are registered directly."""
    for name, p in source.named_parameters(recurse=False):
        if id(p) in keep:
            into.register_parameter(name, p)
    for name, b in source.named_buffers(recurse=False):
        if id(b) in keep:
            persistent = name not in getattr(source, "_non_persistent_buffers_set", set())
            into.register_buffer(name, b, persistent=persistent)
    for name, child in source.named_children():
        held = _ids(child)
        if not held & keep:
            continue
        if held <= keep:
            into.add_module(name, child)
        else:
            sub = nn.Module()
            into.add_module(name, sub)
            mirror_tree(sub, child, keep)


class StageRoot(nn.Module):
    """This rank's stages of a pipeline: ``forward(x, stage)`` runs stage ``stage`` (an index of the
    whole pipeline); parameters and buffers are registered under their names in the whole model."""

    def __init__(self, module: nn.Module, stages: Mapping[int, nn.Module]) -> None:
        super().__init__()
        keep: set[int] = set()
        for stage in stages.values():
            keep |= _ids(stage)
        mirror_tree(self, module, keep)
        self.__dict__["_run"] = dict(stages)  # not registered: the paths above name every tensor once

    def forward(self, x: torch.Tensor, stage: int, *inputs: torch.Tensor) -> Any:
        """Stage ``stage`` on ``x``; a stage of a model split at module names also takes the
        micro-batch's model ``inputs`` (its copy of the model's forward recomputes positions, masks)."""
        run: dict[int, nn.Module] = self.__dict__["_run"]
        return run[stage](x, *inputs)

    def train(self, mode: bool = True) -> StageRoot:
        super().train(mode)
        for stage in self.__dict__["_run"].values():
            stage.train(mode)
        return self
