"""torch.nn.utils.prune on ZeRO-3/FSDP after wrapping, on 2 in-memory ranks: exact through a gather
(``model.apply(fn)``, ``summon_full_params()``) or refused naming the fix on ``model.module``; the checks
read the prune hooks a bounded number of times."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.utils.prune as prune
from steps import outcome, plain_steps
from test_param_writes import SHARDED, trained
from test_strategies_helpers import Block, make_data, make_module, max_rel_error, wrap
from torch import nn
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import ZeRO3Model
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.testing import run_world


def prune_linears(m: nn.Module) -> None:
    """torch.nn.utils.prune's L1 pruning of half of each nn.Linear's weight (the mask from its values)."""
    if isinstance(m, nn.Linear):
        prune.l1_unstructured(m, "weight", amount=0.5)


def prune_child(m: nn.Module) -> None:
    """Visiting a block, L1-prune its child layer (torch's apply visited the child first)."""
    if isinstance(m, Block):
        prune.l1_unstructured(m.fc, "weight", amount=0.5)


def given_masks(module: nn.Module) -> None:
    """The masks L1 pruning of the plain module computes, given with prune.custom_from_mask."""
    plain = make_module()
    plain.apply(prune_linears)
    masks = {n: m.weight_mask for n, m in plain.named_modules() if isinstance(m, nn.Linear)}
    for n, m in module.named_modules():
        if n in masks:
            prune.custom_from_mask(m, "weight", masks[n])


def pruned_after_wrapping(backend: CommunicationBackend) -> dict[str, Any]:
    """Pruning a wrapped ZeRO-3/FSDP model: on model.module (the stand-ins), inside
    summon_full_params(), through model.apply(fn), on ZeRO-3's parameters kept whole, a child pruned
    by fn(block) in model.apply(fn) and masks given on model.module (no values read)."""
    out: dict[str, Any] = {}
    for name in SHARDED:
        for how in ("module", "summon", "apply", "whole", "child", "given"):
            kw = {"persistence_threshold": 10**6} if how == "whole" else {}
            if how == "whole" and name == "fsdp":
                continue
            model = wrap(name, make_module(), backend, **kw)
            if how == "summon":
                with model.summon_full_params():
                    model.module.apply(prune_linears)
            elif how == "apply":
                model.apply(prune_linears)
            elif how == "child":
                model.apply(prune_child)
            elif how == "given":
                given_masks(model.module)
            else:
                model.module.apply(prune_linears)
            try:
                out[f"{name}/{how}"] = trained(
                    model, ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1), backend.rank, 2
                )
            except StrategyError as exc:
                out[f"{name}/{how}"] = str(exc)
    return out


@pytest.mark.filterwarnings("ignore:ZeRO3Model. persistence_threshold")
def test_pruning_after_wrapping_is_exact_through_a_gather_or_refused() -> None:
    """torch.nn.utils.prune on model.module after wrapping ZeRO-3/FSDP computed its mask from the
    parameters' stand-ins, silently (0.93 relative error after training, against pruning the plain
    module): refused at the step now, naming the fix; inside summon_full_params(), through
    model.apply(fn) and on parameters kept whole it equals one process. A child pruned by fn(block)
    in model.apply(fn) (its units freed by then: a stand-in's mask) trained on silently (1.0 relative
    error: every prune hook present at a write-back was taken as seeing whole values), and masks given
    with prune.custom_from_mask (no values read) were refused: now refused and equal, respectively."""
    module = make_module()
    module.apply(prune_linears)
    want = trained(module, torch.optim.SGD(module.parameters(), lr=0.1), 0, 1)
    for res in run_world(2, pruned_after_wrapping, timeout=60):
        for key, got in res.items():
            if key.endswith(("/module", "/child")):
                assert isinstance(got, str) and "torch.nn.utils.prune applied after wrapping" in got, got
                assert "with model.summon_full_params()" in got, got
            else:
                assert not isinstance(got, str), (key, got)
                assert max_rel_error(got, want) <= 1e-6, key


def applied_walks(backend: CommunicationBackend, blocks: int, walked: list[int]) -> int:
    """``model.apply(fn)`` over a ZeRO-3 model of ``blocks`` blocks; returns its module count."""
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(blocks)])
    model = ZeRO3Model(net, backend, persistence_threshold=0)
    walked.clear()
    model.apply(prune_linears)  # each Linear pruned while gathered: vetted, so the step trains
    model(torch.ones(2, 4)).sum().backward()
    ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1).step()
    return sum(1 for _ in net.modules())


def test_model_apply_reads_each_modules_prune_hooks_a_bounded_number_of_times(monkeypatch: Any) -> None:
    """model.apply(fn) under ZeRO-3/FSDP vetted prune hooks by walking every module after each module's
    write-back: quadratic in the module count (0.48 s -> 8.1 s per apply of a 1,201-module model on 2
    in-memory ranks); each write-back now reads the hooks of its units' own modules."""
    from dtlab.models.dp import _writes

    walked: list[int] = []
    real = _writes.prune_hooks

    def counting(module: nn.Module, recurse: bool = True) -> Any:
        walked.append(sum(1 for _ in module.modules()) if recurse else 1)
        return real(module) if recurse else real(module, recurse)

    monkeypatch.setattr(_writes, "prune_hooks", counting)
    (modules,) = run_world(1, applied_walks, 24, walked, timeout=60)
    assert sum(walked) <= 4 * modules, (sum(walked), modules)


def pruned_after_steps(backend: CommunicationBackend) -> list[str]:
    """FSDP: three clean steps, then model.module pruned (the stand-ins): each step's outcome."""
    model = wrap("fsdp", make_module(), backend)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    x, y = make_data(4, 8)
    mine = slice(backend.rank * 4, (backend.rank + 1) * 4)
    said = []
    for i in range(4):
        if i == 3:
            model.module.apply(prune_linears)
        said.append(outcome(plain_steps, model, opt, [(x[i, mine], y[i, mine])], F.mse_loss))
    return said


def test_the_check_for_pruning_before_each_step_reads_the_hooks_only_after_a_change(monkeypatch: Any) -> None:
    """ZeRO-3/FSDP's check before each step compares each unit-holding module's hook count, newest hook
    and class with those of the last clean check, and reads the hooks only when one changed (before:
    every step). Pruning after clean steps is still refused."""
    from dtlab.models.dp._writes import ParamWrites

    reads: list[int] = []
    read = ParamWrites._prunings

    def counted(self: ParamWrites) -> list[Any]:
        reads.append(1)
        return read(self)

    monkeypatch.setattr(ParamWrites, "_prunings", counted)
    for said in run_world(2, pruned_after_steps, timeout=60):
        assert said[:3] == ["ran"] * 3 and "torch.nn.utils.prune applied after wrapping" in said[3], said
    assert len(reads) == 2 * 2, len(reads)  # per rank: the first step's check, the one after pruning
