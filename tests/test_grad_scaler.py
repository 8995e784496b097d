"""fp16 loss scaling in a user's own loop (torch.amp.GradScaler's calls: scale, backward, unscale_,
clip, step, update) on 2 in-memory ranks equals one process running torch's GradScaler on the global
batch, under DDP, ZeRO-1/2/3, FSDP, tensor parallelism (tp=2) and a pipeline (pp=2): the same weights
after every step, the same scale sequence and the same skipped step, with an overflow in one
parameter's gradient on rank 1 only (under tp: in rank 1's piece; a rank checking its own part would
step while the other skips). Clipping to 0.5 acts at every step (global norms 1.2 to 8.2), so the
gradients must be unscaled before it. torch's own GradScaler is refused wherever a rank holds part of
the gradient, naming dtlab.optimizers.GradScaler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from test_strategies_helpers import OPTIMIZERS, STRATEGIES, make_data, make_module, optimizer_for, wrap
from test_tensor_habits import PLAN, build
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer, GradientCompressionOptimizer, GradScaler
from dtlab.testing import run_world

STEPS, BAD, CLIP = 4, 1, 0.5
SCALER = {"init_scale": 2.0**10, "growth_interval": 2}
Record = tuple[list[float], list[dict[str, torch.Tensor]]]


class _Spike(torch.autograd.Function):
    """``x * w`` whose backward gives ``w[-1]`` an infinite gradient: an overflow in one parameter's
    gradient only (the inputs' gradients stay finite)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        gw = (g * x).reshape(-1, w.numel()).sum(0)
        gw[-1] = float("inf")
        return g * w, gw


class Gain(nn.Module):
    """An element-wise gain; while ``spike`` is set its gradient overflows."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.spike = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Spike.apply(x, self.weight) if self.spike else x * self.weight


def loop(
    opt: Any, scaler: Any, backward: Callable[[int], None], clip: Callable[[], Any], state: Callable[[], Any]
) -> Record:
    """torch's documented loop: the scales and the weights after every step."""
    scales, states = [], []
    for s in range(STEPS):
        backward(s)
        scaler.unscale_(opt)
        clip()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        states.append({k: v.detach().clone() for k, v in state().items()})
    return scales, states


def reference(case: str) -> Record:
    """One process, torch's GradScaler, the global batch; the spike at step BAD."""
    module, gain, data, loss_fn = _model(case)
    lr = OPTIMIZERS["sgd"][1] if case == "dp" else {"lr": 0.1}
    opt = torch.optim.SGD(module.parameters(), **lr)
    scaler = torch.amp.GradScaler("cpu", **SCALER)

    def backward(s: int) -> None:
        gain.spike = s == BAD and case != "tp"
        x, y = data(s)
        scaler.scale(loss_fn(module(x), y)).backward()
        if s == BAD and case == "tp":  # in the row tp rank 1 holds
            _poke(module, 16)

    return loop(
        opt, scaler, backward, lambda: nn.utils.clip_grad_norm_(module.parameters(), CLIP), module.state_dict
    )


def _model(case: str) -> tuple[nn.Module, Gain, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Any]:
    """The module (its Gain last), the gain, step ``s``'s global batch and the loss of ``case``."""
    g = torch.Generator().manual_seed(3)
    if case == "dp":
        x, y = make_data(STEPS, 8)
        gain = Gain(y.shape[-1])
        module = nn.Sequential(*make_module(), gain)
        return module, gain, lambda s: (x[s], y[s]), F.mse_loss
    if case == "tp":
        x, y = torch.randn(STEPS, 8, 8, generator=g), torch.randint(0, 4, (STEPS, 8), generator=g)
        gain = Gain(4)
        return nn.Sequential(build(), gain), gain, lambda s: (x[s], y[s]), F.cross_entropy
    x, y = torch.randn(STEPS, 8, 6, generator=g), torch.randn(STEPS, 8, 6, generator=g)
    layers = [nn.Linear(6, 6) for _ in range(3)]
    with torch.no_grad():  # values from the private generator (ranks are threads sharing torch's RNG)
        for p in (p for layer in layers for p in layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    gain = Gain(6)
    module = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2], gain)
    return module, gain, lambda s: (x[s], y[s]), F.mse_loss


def _poke(module: nn.Module, row: int) -> None:
    """An overflow in row ``row`` of the column-parallel ``fc1``'s gradient (tp: rank 1's piece only; a
    replicated parameter's gradient is the same on every tp rank, so an overflow there is too)."""
    grad = module[0].fc1.weight.grad
    assert grad is not None
    grad[row, 0] = float("inf")


def _wrapped(case: str, module: nn.Module, backend: CommunicationBackend) -> tuple[Any, Any]:
    if case in STRATEGIES:
        model = wrap(case, module, backend)
        return model, optimizer_for(case, model, "sgd")
    mesh = Mesh(backend, {case: 2})
    if case == "tp":
        model = TensorParallelModel(module, mesh, plan={f"0.{k}": v for k, v in PLAN.items()})
    else:
        model = PipelineParallelModel(module, mesh, micro_batches=2)
    return model, DDPOptimizer(model, torch.optim.SGD, lr=0.1)


def _run(case: str, backend: CommunicationBackend, scaler: Any) -> Record | str:
    """``case`` on this rank: data parallelism on this rank's half of each global batch, tp and pp on
    all of it; the spike on rank 1 only."""
    module, gain, data, loss_fn = _model("dp" if case in STRATEGIES else case)
    model, opt = _wrapped(case, module, backend)
    r = backend.rank

    def backward(s: int) -> None:
        gain.spike = s == BAD and r == 1 and case != "tp"
        x, y = data(s)
        if case in STRATEGIES:
            x, y = x[r * 4 : (r + 1) * 4], y[r * 4 : (r + 1) * 4]
        if case == "pp":  # the schedule runs forward and backward; the loss on the last stage
            model.train_step((x, y), lambda out, t: scaler.scale(loss_fn(out, t)))
        else:
            scaler.scale(loss_fn(model(x), y)).backward()
        if s == BAD and r == 1 and case == "tp":
            _poke(model.module, 0)

    try:
        return loop(opt, scaler, backward, lambda: opt.clip_grad_norm_(CLIP), model.full_state_dict)
    except StrategyError as exc:  # torch's GradScaler where a rank holds part of the gradient
        return str(exc)
    except AssertionError as exc:  # torch's, on a first pipeline stage: scale() never ran there
        return f"torch: {exc}"


def scaled_world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in (*STRATEGIES, "tp", "pp"):
        out[case] = _run(case, backend, GradScaler("cpu", **SCALER))
        out[f"torch/{case}"] = _run(case, backend, torch.amp.GradScaler("cpu", **SCALER))
    # compressors keep error-feedback residuals across steps: gradients of different scales would mix
    model = wrap("ddp", make_module(), backend)
    opt = GradientCompressionOptimizer(DDPOptimizer(model, torch.optim.SGD, lr=0.1))
    for name, scaler in (
        ("compression", GradScaler("cpu")),
        ("torch/compression", torch.amp.GradScaler("cpu")),
    ):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3))).backward()
        try:  # torch's over DDP's whole gradients was not refused: 0.4% from no scaler after 6 steps
            scaler.step(opt)  # of TopkA at 30% with the scale doubling at each
            out[name] = "ran"
        except StrategyError as exc:
            out[name] = str(exc)
    return out


def test_state_dict_is_torch_s() -> None:
    """torch's GradScaler loads dtlab's state and dtlab's loads torch's (keys, scale, growth tracker)."""
    ours = GradScaler("cpu", init_scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    ours.scaler.update(overflow=False)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    back = GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    want = {"scale": 3.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 5}
    assert back.state_dict() == ours.state_dict() == {**want, "_growth_tracker": 1}


def test_scale_promotes_a_0_dim_loss_as_torch_s() -> None:
    """A 0-dim float16 or bfloat16 loss is scaled in float32 (torch multiplies by a float32 tensor);
    a float16 tensor with dimensions stays float16, as in torch."""
    for loss in (
        torch.tensor(3.0, dtype=torch.float16),
        torch.tensor(3.0, dtype=torch.bfloat16),
        torch.ones(2).half(),
    ):
        theirs = torch.amp.GradScaler("cpu").scale(loss)
        ours = GradScaler("cpu").scale(loss)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (ours, theirs)


def test_grad_scaler_loop_equals_one_process_and_torch_s_is_refused() -> None:
    torch.set_num_threads(1)
    results = run_world(2, scaled_world, timeout=120)
    for case in (*STRATEGIES, "tp", "pp"):
        scales, states = reference("dp" if case in STRATEGIES else case)
        assert scales == [1024.0, 512.0, 512.0, 1024.0], case
        skipped = all(torch.equal(states[BAD][k], states[BAD - 1][k]) for k in states[BAD])
        assert skipped, f"{case}: the reference did not skip step {BAD}"
        for rank, out in enumerate(results):
            for name in ("compression", "torch/compression"):
                assert "gradient compression" in out[name] and "bf16" in out[name], out[name]
            torch_s = out[f"torch/{case}"]
            if case == "ddp":  # whole averaged gradients on every rank: torch's GradScaler works too
                _check(torch_s, scales, states, f"torch's GradScaler, {case} rank {rank}")
            elif case == "pp" and rank == 0:  # the first stage: no loss, so torch's scale() never ran
                assert isinstance(torch_s, str) and "scaler.scale(" in torch_s, f"{case}: {torch_s}"
            else:
                assert isinstance(torch_s, str) and "dtlab.optimizers.GradScaler" in torch_s, (
                    f"{case}: {torch_s}"
                )
            _check(out[case], scales, states, f"{case} rank {rank}")


def _check(got: Record | str, scales: list[float], states: list[dict[str, torch.Tensor]], where: str) -> None:
    assert not isinstance(got, str), f"{where}: {got}"
    assert got[0] == scales, f"{where}: scales {got[0]} != {scales}"
    for s, (mine, want) in enumerate(zip(got[1], states, strict=True)):
        err = max(float((mine[k] - want[k]).abs().max()) for k in want)
        assert err <= 1e-5, f"{where} step {s}: max abs error {err:.2e}"


class _Half(nn.Linear):
    """A Linear whose parameters may be float16, taking and giving float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).float()


def _float16_world(backend: CommunicationBackend, case: str) -> str:
    """``case`` "zero2": every parameter float16; "pp": stage 1's only (the refusal must be agreed)."""
    layers = [_Half(6, 6) for _ in range(2)]
    if case == "pp":
        layers[1].half()
        model: Any = PipelineParallelModel(nn.Sequential(*layers), Mesh(backend, {"pp": 2}), micro_batches=2)
        opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
    else:
        model = wrap("zero2", nn.Sequential(*layers).half(), backend)
        opt = optimizer_for("zero2", model, "sgd")
    scaler = GradScaler("cpu")
    x, y = torch.ones(4, 6), torch.zeros(4, 6)
    if case == "pp":
        model.train_step((x, y), lambda out, t: scaler.scale(F.mse_loss(out, t)))
    else:
        scaler.scale(F.mse_loss(model(x), y)).backward()
    try:
        scaler.step(opt)
    except StrategyError as exc:
        return str(exc)
    return "stepped"


def test_float16_parameters_are_refused_as_torch_s_grad_scaler_does() -> None:
    """float16 gradients unscaled in float16 underflow: refused on every rank (under a pipeline too,
    where only stage 1 holds float16 parameters), naming the parameter and the fix."""
    for case in ("zero2", "pp"):
        said = run_world(2, _float16_world, case, timeout=60)
        for rank, text in enumerate(said):
            assert "Attempting to unscale FP16 gradients" in text and "torch.autocast" in text, (case, text)
            if case == "zero2" or rank == 1:
                assert "parameter '" in text and "is float16" in text, (case, text)
