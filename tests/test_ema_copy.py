"""EMA / SWA of a wrapped model and copies of it (docs/porting.md, "EMA / SWA / copying a wrapped
model"): ``copy.deepcopy``, ``AveragedModel`` and ``torch.save`` of a wrapper, and of a module whose
parameters a strategy shards or splits, are refused with one dtlab error naming the fix; the fixes it
names (``AveragedModel(model.module)`` under DDP/ZeRO-1/2, an EMA of ``model.state_dict()`` or of
``model.sharded_state_dict()`` elsewhere) give the EMA of one process training on the global batch."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, wrap
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from dtlab.backends import CommunicationBackend, Mesh
from dtlab.checkpoint import full_tensors_from_shards
from dtlab.core.state import ShardedState
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

DECAY, STEPS, BATCH, LR = 0.9, 3, 8, 0.1
WHOLE_FIX = "AveragedModel(model.module)"  # named for DDP, ZeRO-1/2
VALUES_FIX = "model.state_dict()"  # named for the sharded strategies and the compositions
REFUSED = "cannot be copied or pickled"


def _reference() -> dict[str, torch.Tensor]:
    """One process: torch's AveragedModel EMA after each SGD step on the global batch."""
    x, y = make_data(STEPS, BATCH)
    m = make_module()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    for s in range(STEPS):
        nn.functional.mse_loss(m(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(m)
    return {k: v.detach().clone() for k, v in ema.module.state_dict().items()}


def _refusals(objs: dict[str, Any]) -> dict[str, str]:
    """What each copy of each object raises: '' when it is allowed."""
    out: dict[str, str] = {}
    for what, obj in objs.items():
        for how, fn in (
            ("deepcopy", copy.deepcopy),
            ("copy", copy.copy),  # a shallow copy of a plain module shares its tensors, as in torch
            ("averaged", lambda o: AveragedModel(o, multi_avg_fn=get_ema_multi_avg_fn(DECAY))),
            ("save", lambda o: torch.save(o, io.BytesIO())),
        ):
            if how == "copy" and what == "module":
                continue
            try:
                fn(obj)
                out[f"{what}/{how}"] = ""
            except StrategyError as e:
                out[f"{what}/{how}"] = str(e)
    return out


class _Emas:
    """The documented recipes, updated after each step: torch's AveragedModel of ``model.module``
    (DDP/ZeRO-1/2, a pipeline rank's stages), an EMA of ``model.state_dict()`` (whole, every rank) and
    of this rank's piece of ``model.sharded_state_dict()``."""

    def __init__(self, model: Any, averaged: bool) -> None:
        self.model = model
        self.averaged = (
            AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(DECAY)) if averaged else None
        )
        self.whole: dict[str, torch.Tensor] | None = None
        self.piece: dict[str, torch.Tensor] | None = None
        self.meta: dict[str, Any] = {}

    @staticmethod
    def _lerp(ema: dict[str, torch.Tensor] | None, now: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if ema is None:
            return {k: v.detach().clone() for k, v in now.items()}
        for k, v in now.items():
            if v.is_floating_point():
                ema[k].lerp_(v, 1 - DECAY)
            else:
                ema[k].copy_(v)
        return ema

    def update(self) -> None:
        with torch.no_grad():
            if self.averaged is not None:
                self.averaged.update_parameters(self.model.module)
            self.whole = self._lerp(self.whole, self.model.state_dict())
            piece = self.model.sharded_state_dict()
            self.piece, self.meta = self._lerp(self.piece, piece.tensors), piece.metadata

    def result(self) -> dict[str, Any]:
        assert self.whole is not None and self.piece is not None
        pieces = self.model.world_backend.all_gather_object(ShardedState(self.piece, self.meta))
        out: dict[str, Any] = {"whole": self.whole, "piece": full_tensors_from_shards(pieces)}
        if self.averaged is not None:
            local = self.averaged.module.state_dict()
            out["averaged"] = {k: v.clone() for k, v in local.items() if v.device.type != "meta"}
        return out


def _train(model: Any, opt: Any, step: Callable[[int], None], emas: _Emas) -> None:
    for s in range(STEPS):
        step(s)
        opt.step()
        opt.zero_grad()
        emas.update()


def _data_parallel(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = make_data(STEPS, BATCH)
    per = BATCH // backend.world_size
    mine = slice(backend.rank * per, (backend.rank + 1) * per)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        model = wrap(name, make_module(), backend)
        opt_cls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(
            name, ZeRO3Optimizer
        )
        opt = opt_cls(model, torch.optim.SGD, lr=LR)
        whole = name in ("ddp", "zero1", "zero2")
        emas = _Emas(model, averaged=whole)
        _train(
            model, opt, lambda s, m=model: nn.functional.mse_loss(m(x[s, mine]), y[s, mine]).backward(), emas
        )
        res = emas.result()
        res["refused"] = _refusals({"wrapper": model, "module": model.module})
        res["class"] = type(model).__name__
        if whole:  # the copy carries no hook of the wrapper: its backward reduces nothing into it
            assert emas.averaged is not None
            emas.averaged.module(x[0, mine]).sum().backward()
            res["copy_isolated"] = not model.grads_synced and all(
                p.grad is None or not p.grad.any() for p in model.parameters()
            )
            res["copy_has_grads"] = all(p.grad is not None for p in emas.averaged.module.parameters())
        out[name] = res
    return out


def _model_parallel(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = make_data(STEPS, BATCH)
    per = BATCH // backend.world_size
    mine = slice(backend.rank * per, (backend.rank + 1) * per)
    mse = nn.functional.mse_loss
    out: dict[str, Any] = {}
    for name in ("tensor", "pipeline", "hybrid"):
        if name == "tensor":  # every tp rank sees the whole batch
            model: Any = TensorParallelModel(
                make_module(), backend, {"1.fc": "colwise_gather_output", "3": "rowwise_split_input"}
            )
            opt: Any = ZeRO1Optimizer(model, torch.optim.SGD, lr=LR)
            step: Callable[[int], None] = lambda s, m=model: mse(m(x[s]), y[s]).backward()  # noqa: E731
        elif name == "pipeline":
            model = PipelineParallelModel(make_module(), backend, micro_batches=2)
            opt = ZeRO1Optimizer(model, torch.optim.SGD, lr=LR)
            step = lambda s, m=model: m.train_step((x[s], y[s]), mse)  # noqa: E731
        else:  # FSDP over dp = 2, through the composition
            model = HybridShardedModel(make_module(), Mesh(backend, {"dp": 2}), "fsdp")
            opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=LR)
            step = lambda s, m=model: mse(m(x[s, mine]), y[s, mine]).backward()  # noqa: E731
        emas = _Emas(model, averaged=name == "pipeline")  # a pipeline rank's module: its own stages
        _train(model, opt, step, emas)
        res = emas.result()
        res["refused"] = _refusals({"wrapper": model, "module": model.module})
        res["class"] = type(model).__name__
        out[name] = res
    return out


def _check(name: str, res: dict[str, Any], ref: dict[str, torch.Tensor]) -> None:
    for form in ("whole", "piece"):
        got = res[form]
        assert set(got) == set(ref), (name, form, sorted(set(got) ^ set(ref)))
        err = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert err < 1e-6, (name, form, err)
    if "averaged" in res:
        local = res["averaged"]
        assert local and all(k in ref for k in local), (name, sorted(local))
        err = max(float((local[k] - ref[k]).abs().max()) for k in local)
        assert err < 1e-6, (name, "AveragedModel(model.module)", err)


def _check_refused(name: str, cls: str, refused: dict[str, str], module_copies: bool) -> None:
    for key, msg in refused.items():
        form = key.split("/")[0]
        if form == "module" and module_copies:
            assert msg == "", (name, key, msg)
            continue
        assert REFUSED in msg, (name, key, msg)
        if form == "wrapper":
            assert msg.startswith(f"{cls} cannot be copied"), (name, key, msg)
        assert (
            WHOLE_FIX if form == "wrapper" and name in ("ddp", "zero1", "zero2") else VALUES_FIX
        ) in msg, (
            name,
            key,
            msg,
        )


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _reference()


def test_data_parallel_ema_and_copies(reference: dict[str, torch.Tensor]) -> None:
    ranks = run_world(2, _data_parallel, timeout=120)
    for name in STRATEGIES:
        for r in ranks:
            _check(name, r[name], reference)
        whole = name in ("ddp", "zero1", "zero2")
        for r in ranks:
            _check_refused(name, r[name]["class"], r[name]["refused"], module_copies=whole)
            if whole:
                assert r[name]["copy_isolated"] and r[name]["copy_has_grads"], name


def test_model_parallel_ema_and_copies(reference: dict[str, torch.Tensor]) -> None:
    ranks = run_world(2, _model_parallel, timeout=120)
    for name in ("tensor", "pipeline", "hybrid"):
        for r in ranks:
            _check(name, r[name], reference)
            _check_refused(name, r[name]["class"], r[name]["refused"], module_copies=name == "pipeline")
