"""A model whose last pipeline block returns a tuple (the logits and an auxiliary loss, as a
mixture-of-experts model returns them): ``loss_fn`` gets the tuple, training equals one process on the
global batch, ``model(x)`` gives the tuple on every pipeline rank; a tuple from any other block, or
anything but a tuple of tensors from the last, is refused naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from torch import nn

from dtlab.backends import Mesh
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel
from dtlab.models.pipeline._split import TupleSpec
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

WIDTH = 6


class AuxHead(nn.Module):
    """The last block: the output and a load-balancing-like auxiliary loss (``returns`` varies it)."""

    def __init__(self, returns: str = "tuple") -> None:
        super().__init__()
        self.lin, self.returns = nn.Linear(WIDTH, WIDTH), returns

    def forward(self, x: torch.Tensor) -> Any:
        y, aux = self.lin(x), 0.1 * x.pow(2).mean()
        return {"logits": y, "aux": aux} if self.returns == "dict" else (y, aux)


def make(returns: str = "tuple", middle: bool = False) -> nn.Sequential:
    blocks: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    if middle:  # a tuple from a block whose output crosses a boundary
        blocks[1] = AuxHead()
    return filled(nn.Sequential(*blocks, AuxHead(returns)), 0, scale=0.5)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    y, aux = out
    return F.mse_loss(y, target) + aux


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for _ in range(3)]


def train(backend: Any, axes: dict[str, int], schedule: str, dp: str) -> dict[str, Any]:
    mesh = Mesh(backend, axes)
    model = HybridShardedModel(make(), mesh, dp, schedule=schedule, micro_batches=2)
    opt = (ZeRO3Optimizer if dp == "fsdp" else DDPOptimizer)(model, torch.optim.SGD, lr=0.2)
    share, c = 8 // mesh.size("dp"), mesh.coordinate("dp")
    for x, y in data():
        model.train_step((x[c * share : (c + 1) * share], y[c * share : (c + 1) * share]), loss_fn)
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(data()[0][0])
    return {"state": model.full_state_dict(), "out": out}


@pytest.mark.parametrize(
    ("axes", "schedule", "dp"),
    [({"pp": 2}, "1f1b", "ddp"), ({"pp": 2}, "zero_bubble", "ddp"), ({"pp": 2, "dp": 2}, "gpipe", "fsdp")],
)
def test_a_last_block_returning_logits_and_an_aux_loss_trains_as_one_process(
    axes: dict[str, int], schedule: str, dp: str
) -> None:
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for x, y in data():
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        want = ref(data()[0][0])
    results = run_world(2 * len(axes), train, axes, schedule, dp, timeout=30)  # refused on main
    for r in results:  # every rank: the whole model and the inference tuple
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)
        assert isinstance(r["out"], tuple) and len(r["out"]) == 2
        for got, expected in zip(r["out"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("returns", "middle", "says"),
    [
        ("dict", False, "pipeline stage 1 (4) returns a dict of 2 entries: {'logits': <Tensor>"),
        ("tuple", True, "pipeline stage 0 (1) returns a tuple; every block must return one tensor"),
    ],
)
def test_other_block_outputs_are_refused_naming_them(returns: str, middle: bool, says: str) -> None:
    def step(backend: Any) -> None:
        model = HybridShardedModel(make(returns, middle), Mesh(backend, {"pp": 2}), split_points=["2"])
        model.train_step(data()[0], loss_fn)

    with pytest.raises(RankFailedError) as info:
        run_world(2, step, timeout=30)
    assert isinstance(info.value.__cause__, StrategyError) and says in str(info.value.__cause__)
    assert "the last may return a tuple of tensors" in str(info.value.__cause__)


def test_a_tuple_outputs_spec_counts_the_bytes_of_every_item() -> None:
    """A TensorSpec's nbytes is what a boundary sends: a tuple's is all its items' (shape and dtype are
    the first's)."""
    spec = TupleSpec.of_items([torch.zeros(2, 3), torch.zeros((), dtype=torch.float32)])
    assert (spec.shape, spec.dtype, spec.nbytes) == ((2, 3), torch.float32, 28)
