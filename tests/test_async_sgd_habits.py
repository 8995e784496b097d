"""AsyncSGDOptimizer against one plain torch process: a parameter without a gradient (unused in a
step) is skipped as torch's optimizer skips a ``.grad`` of None, per clock at staleness 0 and per push
otherwise; ``max_grad_norm`` clips the global batch's gradient (staleness 0; refused otherwise, naming
the per-worker clip); optimizers whose step of a piece differs (Adafactor) or that need a closure
(LBFGS) are refused; ``step(closure)``; param groups with a schedule on the servers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import ArgumentError, StrategyError
from dtlab.optimizers import AsyncSGDOptimizer
from dtlab.testing import run_world

STEPS, OPT = 6, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 2)


def _net() -> TwoHeads:
    return filled(TwoHeads(), 0, scale=0.5)


def _uses_b(t: int, worker: int) -> bool:
    """Head b: every worker at t % 3 == 0, worker 0 alone at t % 3 == 1, nobody at t % 3 == 2."""
    return t % 3 == 0 or (t % 3 == 1 and worker == 0)


def _loss(net: TwoHeads, t: int, worker: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * t + worker)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
    h = torch.tanh(net.body(x))
    loss = nn.functional.mse_loss(net.a(h), y)
    return loss + nn.functional.mse_loss(net.b(h), -y) if _uses_b(t, worker) else loss


def _plain(workers: int, clip: float | None = None, keep: bool = False) -> dict[str, torch.Tensor]:
    """One process: each step's loss is the workers' mean (the servers average the pushes)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), **OPT)
    for t in range(STEPS):
        opt.zero_grad(set_to_none=not keep)
        (sum(_loss(net, t, w) for w in range(workers)) / workers).backward()  # type: ignore[operator]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return net.state_dict()


def _async(
    backend: CommunicationBackend, staleness: int, servers: int, clip: float | None = None, keep: bool = False
) -> dict[str, Any]:
    opt = AsyncSGDOptimizer(
        _net(), backend, torch.optim.SGD, staleness=staleness, num_servers=servers, max_grad_norm=clip, **OPT
    )
    if opt.is_server:
        opt.serve()
    else:
        for t in range(STEPS):
            net: Any = opt.module
            if keep:  # else step() clears the gradients it pushed (to None, as zero_grad() would)
                opt.zero_grad(set_to_none=False)
            if t % 2:
                opt.step(lambda: _loss(net, t, backend.rank - servers).backward())  # noqa: B023 - called at once
            else:
                _loss(net, t, backend.rank - servers).backward()
                opt.step()
        opt.finish()
    return opt.full_state_dict()


@pytest.mark.parametrize(
    ("servers", "workers", "staleness"),
    [(1, 2, 0), (2, 2, 0), (1, 1, 2)],  # staleness 2, one worker: each push is one step, in order
    ids=["1server-sync", "2servers-sync", "1worker-async"],
)
def test_a_parameter_without_a_gradient_is_skipped_as_torch_skips_it(
    servers: int, workers: int, staleness: int
) -> None:
    want = _plain(workers)
    got = run_world(servers + workers, _async, staleness, servers, timeout=30)[0]
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_zero_grad_set_to_none_false_keeps_a_used_parameter_stepped_as_torch() -> None:
    """torch steps a zeroed .grad (head b after its first use, in the steps nobody uses it): so does
    the server when the worker's last zero_grad() kept the gradients (step() then zeroes them)."""
    want = _plain(2, keep=True)
    got = run_world(3, _async, 0, 1, None, True, timeout=30)[0]
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("servers", [1, 2])
def test_max_grad_norm_clips_the_global_batch_gradient_as_one_process(servers: int) -> None:
    want, unclipped = _plain(2, clip=0.3), _plain(2)
    assert any(not torch.allclose(want[k], unclipped[k], rtol=1e-3) for k in want)  # it clipped
    got = run_world(servers + 2, _async, 0, servers, 0.3, timeout=30)[0]
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def _refused(backend: CommunicationBackend) -> list[str]:
    out = []
    with pytest.raises(ArgumentError) as info:
        AsyncSGDOptimizer(_net(), backend, torch.optim.SGD, staleness=2, max_grad_norm=1.0, lr=0.1)
    out.append(str(info.value))
    for cls in (torch.optim.Adafactor, torch.optim.LBFGS):  # a piece's step differs / needs a closure
        with pytest.raises(StrategyError) as refused:
            AsyncSGDOptimizer(_net(), backend, cls, lr=0.01)
        out.append(str(refused.value))
    return out


def test_max_grad_norm_under_staleness_and_non_elementwise_optimizers_are_refused() -> None:
    clip, adafactor, lbfgs = run_world(2, _refused)[0]
    assert "staleness=2" in clip and "max_grad_norm=1.0" in clip and "clip_grad_norm_" in clip
    assert "Adafactor" in adafactor and "element-wise" in adafactor
    assert "LBFGS" in lbfgs and "closure" in lbfgs


def _old_layout(backend: CommunicationBackend) -> str:
    opt = AsyncSGDOptimizer(_net(), backend, torch.optim.SGD, lr=0.1, momentum=0.9)
    if not opt.is_server:
        return ""
    state = opt.state_dict()
    flat = torch.nn.Parameter(state["shard"].clone())  # one tensor over the whole shard: the old layout
    state["optimizer"] = torch.optim.SGD([flat], lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(StrategyError) as info:
        opt.load_state_dict(state)
    return str(info.value)


def test_a_server_state_saved_as_one_flat_tensor_is_refused_naming_the_layout() -> None:
    text = run_world(2, _old_layout)[0]
    assert "covers 1 tensors" in text and "one per parameter piece" in text


def _groups(net: TwoHeads) -> list[dict[str, Any]]:
    """Decay on the matrices at lr 0.1, none on the biases at lr 0.05 (options over the defaults)."""
    ps = dict(net.named_parameters())
    return [
        {"params": [ps["body.weight"], ps["a.weight"], ps["b.weight"]]},
        {"params": [ps["body.bias"], ps["a.bias"], ps["b.bias"]], "lr": 0.05, "weight_decay": 0.0},
    ]


def _grouped(backend: CommunicationBackend, servers: int) -> dict[str, Any]:
    net = _net()
    opt = AsyncSGDOptimizer(
        net, backend, torch.optim.SGD, num_servers=servers, param_groups=_groups(net), **OPT
    )
    if opt.is_server:
        schedule = torch.optim.lr_scheduler.StepLR(opt.optimizer, 2, 0.5)  # every group, on each server
        opt.serve(on_update=lambda _: schedule.step())
    else:
        for t in range(STEPS):
            _loss(opt.module, t, backend.rank - servers).backward()  # type: ignore[arg-type]
            opt.step()
        opt.finish()
    return opt.full_state_dict()


@pytest.mark.parametrize("servers", [1, 2])
def test_param_groups_and_a_schedule_train_as_one_process(servers: int) -> None:
    net = _net()
    opt = torch.optim.SGD(_groups(net), **OPT)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for t in range(STEPS):
        opt.zero_grad()
        (sum(_loss(net, t, w) for w in range(2)) / 2).backward()  # type: ignore[operator]
        opt.step()
        schedule.step()
    got = run_world(servers + 2, _grouped, servers, timeout=30)[0]
    for k, v in net.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def _bad_groups(backend: CommunicationBackend) -> list[str]:
    net = _net()
    ps = list(net.parameters())
    out = []
    for groups in (
        [{"params": ps}, {"params": ps[:1]}],
        [{"params": ps[1:]}],
        [{"params": [torch.zeros(2)]}],
    ):
        with pytest.raises(StrategyError) as info:
            AsyncSGDOptimizer(net, backend, torch.optim.SGD, param_groups=groups, lr=0.1)
        out.append(str(info.value))
    return out


def _other_lr(backend: CommunicationBackend) -> str:
    net = _net()
    groups = [{"params": list(net.parameters()), "lr": 0.1 * (1 + backend.rank)}]  # a rank's own lr
    with pytest.raises(StrategyError) as info:
        AsyncSGDOptimizer(net, backend, torch.optim.SGD, param_groups=groups, lr=0.1)
    return str(info.value)


def test_param_groups_that_miss_or_repeat_a_parameter_or_differ_between_ranks_are_refused() -> None:
    assert all("every rank must pass the same model and settings" in t for t in run_world(2, _other_lr))
    twice, missing, foreign = run_world(2, _bad_groups)[0]
    assert "'body.weight' is in param groups 0 and 1" in twice
    assert "['body.weight'] are in no param group" in missing and "requires_grad_(False)" in missing
    assert "not a trainable parameter of the module" in foreign
