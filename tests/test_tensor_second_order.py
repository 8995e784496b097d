"""A gradient penalty on the inputs (WGAN-GP's, R1, double backprop: ``torch.autograd.grad(loss, x,
create_graph=True)``, then a loss on that gradient) under tensor parallelism. The tp collectives ran
their backward outside autograd, so the second backward took each for the identity: 0.49 relative
error against one process after 3 SGD steps at tp=2 (float32), no error. Their backward is now
recorded as the adjoint collective: one process's parameters (float64: 1e-15), at tp=4 and dp2 x tp2.
The vocabulary-parallel cross entropy (a head left split) has no second derivative: such a penalty
through it trained with 1.0 relative error; it is now refused on every rank, naming the gathered head
and ``F.cross_entropy``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from filled import filled
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.models.tensor import ColwiseParallel, RowwiseParallel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world

STEPS, LR, CLASSES = 3, 0.5, 8


class Net(nn.Module):
    """A column/row-parallel block with a residual, then a column-parallel head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x + self.fc2(torch.tanh(self.fc1(x))))
        return out


def _plan(gather: bool) -> dict[str, Any]:
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "head": ColwiseParallel(gather_output=gather)}


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, 8, 8, generator=gen, dtype=torch.float64)  # second derivatives: round-off
    return list(zip(x, torch.randint(0, CLASSES, (STEPS, 8), generator=gen), strict=True))


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> None:
    x = x.clone().requires_grad_(True)
    loss = loss_fn(model(x), y)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad.pow(2).sum()).backward()
    opt.step()
    opt.zero_grad()


def _net() -> Net:
    return filled(Net(), 0, scale=0.5).double()


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in ({"tp": 4}, {"dp": 2, "tp": 2}):
        # every dp replica the whole batch: its penalty is one process's (on a part of the batch each
        # rank's penalty is on its own mean loss's input gradient, as under torch's DDP)
        model = TensorParallelModel(_net(), Mesh(backend, shape), plan=_plan(gather=True))
        opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
        for x, y in _data():
            _step(model, opt, x, y, F.cross_entropy)
        out[str(shape)] = model.full_state_dict()
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    split = TensorParallelModel(_net(), mesh, plan=_plan(False))
    opt = DDPOptimizer(split, torch.optim.SGD, lr=LR)
    x, y = _data()[0]
    try:
        _step(split, opt, x, y, split.cross_entropy)
        out["split"] = "ran"
    except StrategyError as exc:
        out["split"] = str(exc)
    return out


def test_an_input_gradient_penalty_under_tensor_parallelism_equals_one_process() -> None:
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for x, y in _data():
        _step(plain, opt, x, y, F.cross_entropy)
    for got in run_world(4, _world, timeout=60):
        for shape in ("{'tp': 4}", "{'dp': 2, 'tp': 2}"):
            for k, v in plain.state_dict().items():
                torch.testing.assert_close(got[shape][k], v, rtol=1e-10, atol=1e-12, msg=f"{shape} {k}")
        assert "cross entropy (model.cross_entropy on logits split over tp) has no second" in got["split"]
        assert "'colwise_gather_output'" in got["split"]
