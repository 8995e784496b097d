"""`python -m dtlab.benchmarks.vs_deepspeed` without DeepSpeed, and its count of the tensors a
DeepSpeed engine holds, on a stand-in engine (the benchmark itself needs DeepSpeed and is run by hand;
no test needs DeepSpeed)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtlab.benchmarks import _vs_deepspeed_engine, vs_deepspeed
from dtlab.core import seeded_init


def test_without_deepspeed_it_exits_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_vs_deepspeed_engine, "ds_version", lambda: None)
    monkeypatch.setattr(sys, "argv", ["vs_deepspeed", "--stages", "1"])
    with pytest.raises(SystemExit) as exc:
        vs_deepspeed.main()
    assert "deepspeed is not importable" in str(exc.value)
    assert _vs_deepspeed_engine.DS_INSTALL in str(exc.value)


def test_held_bytes_count_each_storage_once_by_kind() -> None:
    with seeded_init(0):
        module = nn.Linear(8, 4)  # 32 + 4 floats
    inner = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(2, 8)).sum().backward()
    inner.step()  # a momentum buffer per parameter: 36 floats
    master = torch.zeros(18)
    master.grad = torch.zeros(18)
    bucket = torch.zeros(50)
    zero = SimpleNamespace(
        optimizer=inner,
        single_partition_of_fp32_groups=[master],  # 18 + its .grad 18 floats
        averaged_gradients={0: [bucket[:10], bucket[10:20]]},  # views: the bucket's 50 floats once
        ipg_buffer=[bucket],  # already counted
        round_robin_meta=[torch.empty(1000, device="meta")],  # no memory
        weights_again=[module.weight],  # already counted with the parameters
    )
    held = _vs_deepspeed_engine.ds_held_bytes(SimpleNamespace(module=module, optimizer=zero))
    assert held["parameters"] == 4 * 36 and held["gradients"] == 4 * 36 + 4 * 50
    assert held["optimizer_state"] == 4 * 36 and held["master"] == 4 * 36 and held["other"] == 0
    assert held["attributes"] == {"averaged_gradients": 200, "single_partition_of_fp32_groups": 144}
