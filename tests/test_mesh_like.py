"""``MeshLike``: a user's own mesh object drives a model-parallel strategy as ``Mesh`` does (same
losses and state, step for step), ``Mesh`` is one, and an object that is neither a mesh nor a backend
is refused with the class it got."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from steps import plain_steps
from test_tensor_helpers import batch, build, initial_state

from dtlab.backends import CommunicationBackend, Mesh, MeshLike
from dtlab.backends.mesh import Axes
from dtlab.models import TensorParallelModel, transformer_plan
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world


class TpOnlyMesh:
    """A user's own mesh, without dtlab's ``Mesh``: one ``tp`` axis over the whole backend; every
    other axis has size 1 (a group of this rank alone)."""

    def __init__(self, backend: CommunicationBackend) -> None:
        alone = backend.split(backend.rank, 0)
        assert alone is not None
        self._backend, self._alone = backend, alone

    @property
    def backend(self) -> CommunicationBackend:
        return self._backend

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("tp",)

    @property
    def shape(self) -> dict[str, int]:
        return {"tp": self._backend.world_size}

    def __contains__(self, axis: object) -> bool:
        return axis == "tp"

    def _has_tp(self, axes: Axes) -> bool:
        return "tp" in ((axes,) if isinstance(axes, str) else axes)

    def size(self, axes: Axes) -> int:
        return self._backend.world_size if self._has_tp(axes) else 1

    def coordinate(self, axes: Axes) -> int:
        return self._backend.rank if self._has_tp(axes) else 0

    def ranks(self, axes: Axes) -> list[int]:
        return list(range(self._backend.world_size)) if self._has_tp(axes) else [self._backend.rank]

    def __getitem__(self, axes: Axes) -> CommunicationBackend:
        return self._backend if self._has_tp(axes) else self._alone


def _train(mesh: MeshLike) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TensorParallelModel(build(initial_state(), torch.float32), mesh, transformer_plan())
    opt = DDPOptimizer(model, torch.optim.SGD, lr=0.5)
    x, y = batch()
    return plain_steps(model, opt, [(x, y)] * 2, model.cross_entropy), model.full_state_dict()


def _both(backend: CommunicationBackend) -> dict[str, Any]:
    mine, theirs = _train(TpOnlyMesh(backend)), _train(Mesh(backend, {"tp": backend.world_size}))
    return {
        "losses": (mine[0], theirs[0]),
        "same": all(torch.equal(mine[1][k], theirs[1][k]) for k in theirs[1]),
    }


def test_a_users_mesh_trains_as_mesh_does() -> None:
    for out in run_world(2, _both, timeout=60):
        assert out["losses"][0] == out["losses"][1]
        assert out["same"]


def test_mesh_is_mesh_like_and_other_objects_are_refused() -> None:
    def world(backend: CommunicationBackend) -> bool:
        mesh = Mesh(backend, {"tp": 1})
        with pytest.raises(TypeError, match=r"takes a dtlab.backends.Mesh \(or a MeshLike\), got dict"):
            TensorParallelModel(build(None, torch.float32), {"tp": 1}, transformer_plan())  # type: ignore[arg-type]
        return isinstance(mesh, MeshLike) and not isinstance(backend, MeshLike)

    assert run_world(1, world) == [True]
