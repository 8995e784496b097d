"""``load_pretrained``: a plain model's safetensors (one file, or sharded with an index) loaded into
ZeRO-3, FSDP (both built on the meta device) and DDP on 2 in-memory ranks is bitwise the saved model,
trains like single-process training from it, and names missing, unexpected and mis-shaped keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pretrained_cases import assert_loaded_bitwise, load_into
from safetensors.torch import save_file, save_model
from steps import plain_steps
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import load_pretrained
from dtlab.core import seeded_init
from dtlab.errors import CheckpointError
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world


def _net() -> nn.Sequential:
    net = nn.Sequential(
        nn.Embedding(13, 7), nn.Linear(7, 24), nn.BatchNorm1d(24), nn.Linear(24, 7), nn.Linear(7, 13)
    )
    net[4].weight = net[0].weight  # tied
    return net


def _save(tmp: Path) -> tuple[dict[str, torch.Tensor], Path, Path]:
    with seeded_init(9):
        net = _net()
    with torch.no_grad():
        net[2].running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    one = tmp / "one"
    one.mkdir()
    save_model(net, str(one / "model.safetensors"))  # the tied copy saved once
    state = {k: v.clone().contiguous() for k, v in net.state_dict().items()}
    sharded = tmp / "sharded"
    sharded.mkdir()
    saved = [k for k in state if k != "4.weight"]
    parts = {"model-00001-of-00002.safetensors": saved[:3], "model-00002-of-00002.safetensors": saved[3:]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(sharded / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return state, one, sharded


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, 13, (3, 8), generator=g), torch.randn(3, 8, 13, generator=g)


def _step_all(model: Any, opt: Any, lo: int, hi: int) -> list[float]:
    x, y = _data()
    return plain_steps(model, opt, zip(x[:3, lo:hi], y[:3, lo:hi], strict=True), nn.functional.mse_loss)


def _load_everywhere(backend: CommunicationBackend, one: Path, sharded: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    r, p = backend.rank, backend.world_size
    for src_name, src in (("one", one), ("sharded", sharded)):
        for name in ("zero3", "fsdp", "ddp"):
            if name == "ddp":
                with seeded_init(1):
                    net = _net()
                model: Any = DDPModel(net, backend)
                opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
            else:
                with torch.device("meta"):
                    net = _net()
                if name == "zero3":
                    model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=1)
                else:
                    model = FSDPModel(
                        net, backend, wrap_policy=ModuleClassPolicy((nn.BatchNorm1d,)), init_seed=1
                    )
                opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
            key = f"{src_name}/{name}"
            out[f"{key}/load"] = load_into(model, src)
            model.eval()
            out[f"{key}/losses"] = _step_all(model, opt, r * 8 // p, (r + 1) * 8 // p)
            out[f"{key}/trained"] = model.full_state_dict()
    return out


def test_pretrained_loads_bitwise_and_trains_like_one_process(tmp_path: Path) -> None:
    state, one, sharded = _save(tmp_path)
    ref = _net()
    ref.load_state_dict(state)
    ref.eval()
    ref_losses = _step_all(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 0, 8)
    ref_state = ref.state_dict()
    results = run_world(2, _load_everywhere, one, sharded)
    for key in [f"{s}/{m}" for s in ("one", "sharded") for m in ("zero3", "fsdp", "ddp")]:
        mean = [sum(v) / 2 for v in zip(*(res[f"{key}/losses"] for res in results), strict=True)]
        assert mean == pytest.approx(ref_losses, rel=1e-5), key
        for res in results:
            assert_loaded_bitwise(res[f"{key}/load"], state, key)
            for k, v in ref_state.items():
                torch.testing.assert_close(res[f"{key}/trained"][k], v, rtol=1e-5, atol=1e-6)


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path: Path) -> None:
    state, _, _ = _save(tmp_path)
    bad = dict(state)
    del bad["4.weight"]
    del bad["1.bias"]
    bad["extra.weight"] = torch.zeros(2)
    bad["3.weight"] = torch.zeros(7, 25)
    save_file(bad, str(tmp_path / "bad.safetensors"))

    def body(backend: CommunicationBackend, strict: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        with torch.device("meta"):
            net = _net()
        model = FSDPModel(net, backend, init_seed=1)
        before = model.full_state_dict()
        report = load_pretrained(model, tmp_path / "bad.safetensors", strict=strict)
        after = model.full_state_dict()
        return (report.missing, report.unexpected, report.mismatched), before["1.bias"], after

    with pytest.raises(Exception, match=r"missing \['1.bias'\], unexpected \['extra.weight'\].*3.weight"):
        run_world(2, body, True)
    for (missing, unexpected, mismatched), bias, after in run_world(2, body, False):
        assert missing == ["1.bias"] and unexpected == ["extra.weight"]
        assert mismatched == ["3.weight: file shape [7, 25], model [7, 24]"]
        assert torch.equal(after["1.bias"], bias)  # missing: kept
        assert torch.equal(after["1.weight"], state["1.weight"])  # the rest loaded

    def empty_dir(backend: CommunicationBackend) -> None:
        load_pretrained(DDPModel(nn.Linear(2, 2), backend), tmp_path)

    with pytest.raises(Exception, match=r"neither model\.safetensors") as info:
        run_world(1, empty_dir)
    assert isinstance(info.value.__cause__, CheckpointError)
