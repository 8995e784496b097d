"""FSDP's root unit, as FSDP2 by default (``reshard_after_forward=None``): kept gathered from its forward
to its backward (which begins by gathering it), one all-gather of the root fewer per step at the same
peak; a forward without gradients frees it; a forward whose backward never comes holds it alone.

The model (``make_module``): Linear(6, 10) and Linear(10, 3) in the root unit (103 parameters: a shard
of 52 float32 on each of 2 ranks, 208 bytes sent per all-gather), the Block a unit (110: 55, 220 bytes).
"""

from __future__ import annotations

from typing import Any

import torch
from live_bytes import LiveBytes
from test_strategies_helpers import Block, make_data, make_module, optimizer_for
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.models import FSDPModel, ModuleClassPolicy
from dtlab.testing import run_world

ROOT, BLOCK = 208, 220  # bytes one rank sends to all-gather each unit (P = 2)


def _gathered(backend: CommunicationBackend) -> int:
    return int(backend.stats["all_gather"].bytes_sent)


def _held(model: Any) -> int:
    return int(model.memory_report()["parameters"])


def _step(model: Any, backend: CommunicationBackend) -> dict[str, Any]:
    x, y = make_data(4, 4)
    opt = optimizer_for("fsdp", model, "adamw")
    sent, losses = [], []
    for i in range(3):
        backend.stats.reset()
        opt.zero_grad()
        if i == 2:  # two micro-batches accumulated (the first in no_sync()), and two forwards in one
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x[i, :2]), y[i, :2]).backward()
            loss = torch.nn.functional.mse_loss(model(x[i, 2:]), y[i, 2:])
            loss = loss + torch.nn.functional.mse_loss(model(x[3, 2:]), y[3, 2:])
        else:
            loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        loss.backward()
        opt.step()
        sent.append(_gathered(backend))
        losses.append(loss.item())
    return {
        "sent": sent,
        "reduced": int(backend.stats["reduce_scatter"].bytes_sent),
        "peak": model.memory_report()["peak_gathered_parameters"],
        "losses": losses,
        "state": model.full_state_dict(),
    }


def _run(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for reshard in (None, True, False):
        for units in (True, False):
            policy = ModuleClassPolicy((Block,)) if units else None
            given = {} if reshard is None else {"reshard_after_forward": reshard}  # None: the default
            model = FSDPModel(make_module(), backend, wrap_policy=policy, **given)
            out[f"{reshard} {units}"] = _step(model, backend)
    model = FSDPModel(make_module(), backend, wrap_policy=ModuleClassPolicy((Block,)))
    opt = optimizer_for("fsdp", model, "adamw")
    x = make_data(1, 4)[0][0]
    at_rest = _held(model)
    with torch.no_grad():
        model(x)
    out["no_grad"] = _held(model) - at_rest
    model.eval()
    with torch.no_grad():
        model(x)
    out["eval"] = _held(model) - at_rest
    model.train()
    backend.stats.reset()
    model(x)  # a forward whose backward never comes
    out["no_backward"] = (_held(model) - at_rest, _gathered(backend))
    backend.stats.reset()
    loss = model(x).sum()  # the next forward reuses the root
    out["again"] = (_held(model) - at_rest, _gathered(backend))
    loss.backward()
    out["after_backward"] = _held(model) - at_rest
    out["property"] = (model.reshard_after_forward, FSDPModel(make_module(), backend).reshard_after_forward)
    model(x)
    opt.zero_grad()
    out["zero_grad"] = _held(model) - at_rest
    return out


def test_root_unit_kept_from_forward_to_backward_as_fsdp2() -> None:
    out = run_world(2, _run)[0]
    default, resharded, kept = out["None True"], out["True True"], out["False True"]
    # steps 1-2: one forward, one backward; step 3: a micro-batch in no_sync(), then two forwards
    # before one backward. Before (the root resharded after its forward, as reshard_after_forward=True
    # still does): 856, 856, 2,140 bytes; now 648, 648, 1,516: the root gathered once per micro-batch,
    # by its first forward (its backward frees it once its gradients are complete)
    assert resharded["sent"] == [2 * ROOT + 2 * BLOCK, 2 * ROOT + 2 * BLOCK, 5 * ROOT + 5 * BLOCK]
    assert default["sent"] == [ROOT + 2 * BLOCK, ROOT + 2 * BLOCK, 2 * ROOT + 5 * BLOCK]
    assert kept["sent"] == [ROOT + BLOCK, ROOT + BLOCK, 2 * ROOT + 2 * BLOCK]
    # one unit (no wrap policy): the whole model gathered once per step (FSDP2 with a root
    # fully_shard only): (P-1)/P of the parameters gathered, as much reduce-scattered (214 padded)
    assert out["None False"]["sent"] == [428, 428, 856]
    assert out["True False"]["sent"] == [856, 856, 2 * 856 + 428]
    assert out["None False"]["reduced"] == out["True False"]["reduced"] == 428
    # the peak of gathered parameters unchanged: the root and the block (104 + 110 float32)
    assert default["peak"] == resharded["peak"] == 4 * (104 + 110)
    assert out["None False"]["peak"] == out["True False"]["peak"] == 4 * 214
    # the same training, bit for bit
    for case in ("None True", "False True", "None False", "True False", "False False"):
        assert out[case]["losses"] == resharded["losses"], case
        for name, value in out[case]["state"].items():
            assert torch.equal(value, resharded["state"][name]), (case, name)
    # a forward without gradients (evaluation) frees the root too
    assert out["no_grad"] == out["eval"] == 0
    # a forward without backward holds the root alone; the next forward reuses it (the block only
    # gathered); its backward, or the optimizer's zero_grad(), frees it
    assert out["no_backward"] == (4 * 104, ROOT + BLOCK)
    assert out["again"] == (4 * 104, BLOCK)
    assert out["after_backward"] == out["zero_grad"] == 0
    assert out["property"] == (None, None)


D = 32


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _LM(nn.Module):
    """The root unit: the embedding and the head, ``(2 V D + V)`` float32."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.Sequential(_Unit(), _Unit())
        self.head = nn.Linear(D, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.emb(ids)))
        return out


def _step_peaks(backend: CommunicationBackend, vocab: int) -> list[int]:
    peaks = []
    for given in ({}, {"reshard_after_forward": True}):
        with seeded_init(0):
            net = _LM(vocab)
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((_Unit,)), **given)
        ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(backend.rank))
        for _ in range(2):  # the second step's: whatever is made once is made in the first
            model.zero_grad_buffers()
            counter = LiveBytes()
            with counter:
                logits = model(ids)
                nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        peaks.append(counter.peak)
    return peaks


def test_root_unit_held_while_the_loss_is_computed() -> None:
    """The cost, as FSDP2's: the root is held while the loss is computed. Where that is the step's
    peak of allocated bytes (a large vocabulary: its logits and their softmax against small blocks),
    the peak rises by the root's gathered bytes, exactly; elsewhere (a small root) not at all."""
    big, small = run_world(2, lambda b: (_step_peaks(b, 2048), _step_peaks(b, 64)))[0]
    assert big[0] - big[1] == (2 * 2048 * D + 2048) * 4  # 532,480 B: the root, gathered
    assert small[0] == small[1]
