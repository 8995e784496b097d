"""ZeRO-2's transient gradient buckets are taken uninitialized: every element the reduce-scatter sums
must be written first. Fresh memory is filled with NaN here (torch's deterministic mode fills what
``torch.empty`` returns), so a bucket's padding or the slot of a parameter without gradient left
unwritten reaches the shards, the clipped global norm and the step as NaN."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.models import ZeRO2Model
from dtlab.optimizers import ZeRO2Optimizer
from dtlab.testing import run_world


class _Branch(nn.Module):
    """11 parameters in one bucket: 1 element of padding at 2 and 3 ranks; ``unused`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 2, generator=g)


@contextmanager
def _nan_in_fresh_memory() -> Iterator[None]:
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        assert bool(torch.empty(4).isnan().all())
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def _train(backend: CommunicationBackend) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    x, y = _data()
    p, r = backend.world_size, backend.rank
    model = ZeRO2Model(filled(_Branch(), 5), backend, find_unused_parameters=True)
    opt = ZeRO2Optimizer(model, torch.optim.SGD, lr=0.1)
    norms = []
    for s in range(x.shape[0]):
        lo, hi = 6 * r // p, 6 * (r + 1) // p
        nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi]).backward()
        norms.append(float(opt.clip_grad_norm_(0.5)))
        opt.step()
        opt.zero_grad()
    return norms, model.full_state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
def test_padding_and_a_gradless_slot_never_reach_the_norm_or_the_step(world_size: int) -> None:
    x, y = _data()
    ref = filled(_Branch(), 5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_norms = []
    for s in range(x.shape[0]):
        nn.functional.mse_loss(ref(x[s]), y[s]).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    assert min(ref_norms) > 0.5  # the clipping scales every step
    with _nan_in_fresh_memory():
        results = run_world(world_size, _train, timeout=60)
    for rank, (norms, state) in enumerate(results):
        assert norms == pytest.approx(ref_norms, rel=1e-5), (world_size, rank)
        for name, want in ref.state_dict().items():
            assert torch.allclose(state[name], want, rtol=1e-5, atol=1e-7), (world_size, rank, name)
