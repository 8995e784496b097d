"""A boolean buffer built on the meta device (a causal mask) has no value that marks it uninitialized:
whether its initialization wrote it is checked instead. Left unwritten it is a named error under ZeRO-3
and a pipeline (it was silently all True: attention saw the future); filled by ``reset_parameters()``
it is the plain build's mask."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import PipelineParallelModel, ZeRO3Model
from dtlab.testing import run_world

SEQ = 6


class _Attention(nn.Module):
    """Causal attention whose mask is a boolean buffer; ``reset_parameters()`` initializes its own
    temperature (and the mask when ``refill``)."""

    def __init__(self, refill: bool) -> None:
        super().__init__()
        self.refill = refill
        self.qkv = nn.Linear(8, 24)
        self.temperature = nn.Parameter(torch.empty(()))
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.temperature)
        if self.refill:
            self.mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=self.mask.device).tril()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2) * self.temperature).masked_fill(~self.mask, float("-inf"))
        return scores.softmax(-1) @ v


def _wrap(backend: CommunicationBackend, how: str, refill: bool) -> Any:
    with torch.device("meta"):
        net = nn.Sequential(_Attention(refill), nn.Linear(8, 8))
    if how == "zero3":
        return ZeRO3Model(net, backend, persistence_threshold=0, init_seed=0)
    return PipelineParallelModel(net, backend, micro_batches=1, split_points=["1"], init_seed=0)


@pytest.mark.parametrize("how", ["zero3", "pipeline"])
def test_a_boolean_buffer_nothing_writes_is_named(how: str) -> None:
    with pytest.raises(Exception, match=r"buffer 'mask' of module '0' \(_Attention\).*uninitialized"):
        run_world(2, lambda backend: _wrap(backend, how, refill=False))


def test_a_boolean_buffer_its_reset_writes_is_the_plain_builds() -> None:
    x = torch.randn(2, SEQ, 8, generator=torch.Generator().manual_seed(0))
    with seeded_init(0):
        plain = nn.Sequential(_Attention(refill=True), nn.Linear(8, 8))

    def body(backend: CommunicationBackend) -> tuple[torch.Tensor, torch.Tensor]:
        model = _wrap(backend, "zero3", refill=True)
        return model.module[0].mask.clone(), model(x).detach()

    for mask, out in run_world(2, body):
        assert torch.equal(mask, plain[0].mask)
        torch.testing.assert_close(out, plain(x).detach(), rtol=1e-6, atol=1e-7)
