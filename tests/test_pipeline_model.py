"""PipelineParallelModel beyond parity: exact bytes per stage boundary, activation peaks, inference,
checkpoints across pp sizes and strategies, released stages, clipping, compression, custom autograd
functions and autocast (the split and the refused inputs: test_pipeline_split_refusals.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import STEPS, make_lm, make_mlp, mlp_data, pipeline_rank, reference, worst_error
from torch import nn

from dtlab.backends import Mesh
from dtlab.checkpoint import full_tensors_from_shards
from dtlab.errors import RankFailedError
from dtlab.models import DDPModel, PipelineParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [("1f1b", 4, 4, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_bytes_over_each_stage_boundary(schedule: str, pp: int, m: int, v: int) -> None:
    """Per step, each boundary carries m activations forward and m gradients back, nothing else."""
    results = run_world(pp, pipeline_rank, "mlp", {"pp": pp}, schedule, m, "sgd", 16, v, timeout=60)
    out = results[0]["stage_output_bytes"]  # bytes of one micro-batch's output of each stage
    stages = pp * v
    for r, res in enumerate(results):
        mine = [s for s in range(stages) if s % pp == r]
        want = sum(m * out[s] for s in mine if s < stages - 1) + sum(m * out[s - 1] for s in mine if s > 0)
        assert (res["sent"], res["received"]) == (want, want), (r, res["sent"], res["received"], want)
    assert sum(r["sent"] for r in results) == sum(2 * m * out[b] for b in range(stages - 1))
    assert out[0] == (16 // m) * 6 * 4  # a micro-batch of 16 / m rows of 6 float32


def _peak(backend: Any, schedule: str, m: int) -> int:
    model = PipelineParallelModel(make_mlp(), Mesh(backend, {"pp": 4}), schedule, micro_batches=m)
    xs, ys = mlp_data(2 * m)  # micro-batches of 2 samples whatever m
    model.train_step((xs[0], ys[0]), F.mse_loss)
    return model.memory_report()["activations"]


def test_first_stage_activation_peaks() -> None:
    """GPipe holds m micro-batches' activations on the first stage, 1F1B min(p, m)."""
    peaks = {
        (s, m): run_world(4, _peak, s, m, timeout=60)
        for s in ("gpipe", "1f1b", "zero_bubble")
        for m in (2, 4, 8)
    }
    unit, last = peaks[("gpipe", 2)][0] // 2, peaks[("gpipe", 2)][3] // 2  # one micro-batch's worth
    assert unit > 0 and peaks[("gpipe", 2)][0] == 2 * unit
    for m in (2, 4, 8):
        assert peaks[("gpipe", m)][0] == m * unit
        assert peaks[("1f1b", m)][0] == min(4, m) * unit
        assert peaks[("1f1b", m)][3] == last  # the last stage holds one micro-batch at a time
    # zero-bubble: 1F1B's in-flight micro-batches plus what each I keeps for its W (the linear layers'
    # inputs and output-gradients) until then: more than 1F1B, less than GPipe
    for r in range(4):
        assert peaks[("1f1b", 8)][r] < peaks[("zero_bubble", 8)][r] < peaks[("gpipe", 8)][r]


def _inference(backend: Any, schedule: str, v: int) -> torch.Tensor:
    model = PipelineParallelModel(make_lm(), backend, schedule, micro_batches=2, stages_per_rank=v)
    tokens = torch.arange(24).reshape(3, 8) % 256
    model.eval()
    return model(tokens)


def test_forward_is_inference_with_the_output_on_every_rank() -> None:
    tokens = torch.arange(24).reshape(3, 8) % 256
    with torch.no_grad():
        want = make_lm()(tokens)
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        for out in run_world(2, _inference, schedule, v, timeout=60):
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RankFailedError, match=r"trains through train_step\(\(inputs, targets\), loss_fn\)"):
        run_world(1, lambda b: PipelineParallelModel(make_lm(), b)(tokens), timeout=20)


def _save(backend: Any, pp: int, dp: int, steps: int) -> dict[str, Any]:
    mesh = Mesh(backend, {"pp": pp, "dp": dp})
    model = PipelineParallelModel(make_mlp(), mesh, "1f1b", micro_batches=4)
    opt = ZeRO1Optimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    xs, ys = mlp_data(16)
    share = 16 // dp
    part = slice(mesh.coordinate("dp") * share, (mesh.coordinate("dp") + 1) * share)
    for s in range(steps):
        model.train_step((xs[s][part], ys[s][part]), F.mse_loss)
        opt.step()
        opt.zero_grad()
    return {
        "model": model.sharded_state_dict(),
        "opt": opt.sharded_state_dict(),
        "full": model.full_state_dict(),
    }


def _resume(backend: Any, saved: list[dict[str, Any]], pp: int) -> dict[str, torch.Tensor]:
    model = PipelineParallelModel(make_mlp(seed=7), Mesh(backend, {"pp": pp}), "zero_bubble", micro_batches=4)
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    model.load_sharded_state_dict([s["model"] for s in saved])
    opt.load_sharded_state_dict([s["opt"] for s in saved])
    xs, ys = mlp_data(16)
    for s in range(3, STEPS):
        model.train_step((xs[s], ys[s]), F.mse_loss)
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def _into_ddp(backend: Any, saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    model = DDPModel(make_mlp(seed=7), backend)
    model.load_sharded_state_dict([s["model"] for s in saved])
    return model.full_state_dict()


def test_checkpoint_pp4_loads_at_pp2_into_ddp_and_the_plain_module() -> None:
    saved = run_world(8, _save, 4, 2, 3, timeout=60)  # pp=4 x dp=2, ZeRO-1 optimizer state
    full = saved[0]["full"]
    assert list(full) == list(make_mlp().state_dict())  # keyed like the module
    for other in saved[1:]:
        for k, t in other["full"].items():
            assert torch.equal(t, full[k])
    # model and AdamW state resume at pp=2 under another schedule and optimizer strategy: 5 steps = reference
    resumed = run_world(2, _resume, saved, 2, timeout=60)
    ref_losses, ref_state = reference("mlp", "adamw", 16)
    assert worst_error([{"losses": ref_losses, "state": r} for r in resumed], (ref_losses, ref_state)) <= 1e-5
    for state in run_world(2, _into_ddp, saved, timeout=60):
        assert all(torch.equal(state[k], full[k]) for k in full)
    plain = make_mlp(seed=7)
    plain.load_state_dict(full_tensors_from_shards([s["model"] for s in saved]))
    assert all(torch.equal(plain.state_dict()[k], full[k]) for k in full)


def test_released_stages_and_memory_report() -> None:
    def body(b: Any) -> dict[str, Any]:
        module = make_mlp()
        model = PipelineParallelModel(module, b, "1f1b", micro_batches=2)
        names = [n for n, _ in model.module.named_parameters()]
        meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        xs, ys = mlp_data(4)
        model.train_step((xs[0], ys[0]), F.mse_loss)
        return {"names": names, "meta": meta, "report": model.memory_report()}

    r0, r1 = run_world(2, body, timeout=30)
    assert r0["names"] == [f"{i}.{w}" for i in (0, 2, 4, 6) for w in ("weight", "bias")]
    assert r0["meta"] == r1["names"] and r1["meta"] == r0["names"]
    assert r0["report"]["parameters"] == 4 * (36 + 6) * 4  # this rank's stage only
    assert r0["report"]["activations"] > 0 and set(r0["report"]) >= {"parameters", "gradients", "activations"}


def test_clipping_and_the_finite_check_span_the_mesh() -> None:
    """The global norm sums over stages and counts dp replicas once: clipped training = the reference."""
    ref = reference("mlp", "sgd", 16, clip=0.5)
    for shape in ({"pp": 2}, {"pp": 2, "dp": 2}):
        n = 2 * shape.get("dp", 1)
        results = run_world(n, pipeline_rank, "mlp", shape, "1f1b", 4, "sgd", 16, 1, True, 0.5, timeout=60)
        assert worst_error(results, ref) <= 1e-5, shape
        assert all(r["norms"] == results[0]["norms"] for r in results)
        assert results[0]["norms"][0] > 0.5  # the clip did act

    def nan_on_one_stage(b: Any) -> list[bool]:
        mesh = Mesh(b, {"pp": 2, "dp": 2})
        model = PipelineParallelModel(make_mlp(), mesh, "gpipe", micro_batches=2)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        xs, ys = mlp_data(8)
        model.train_step((xs[0][:4], ys[0][:4]), F.mse_loss)
        finite = [opt.grads_are_finite()]
        if mesh.coordinate("pp") == 1 and mesh.coordinate("dp") == 0:  # one stage, as after a reduce
            next(model.module.parameters()).grad[0, 0] = float("nan")
        finite.append(opt.grads_are_finite())
        return finite

    assert run_world(4, nan_on_one_stage, timeout=60) == [[True, False]] * 4


def _compressed(b: Any, algorithm: str) -> dict[str, Any]:
    from dtlab.compression import Dense, TopkA
    from dtlab.optimizers import GradientCompressionOptimizer

    mesh = Mesh(b, {"pp": 2, "dp": 2})
    model = PipelineParallelModel(make_mlp(), mesh, "1f1b", micro_batches=2)
    compressor = Dense() if algorithm == "dense" else TopkA(density=0.25)
    opt = GradientCompressionOptimizer(
        DDPOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9), compressor, dense_below=0
    )
    xs, ys = mlp_data(16)
    part = slice(mesh.coordinate("dp") * 8, (mesh.coordinate("dp") + 1) * 8)
    losses = []
    for s in range(STEPS):
        loss = model.train_step((xs[s][part], ys[s][part]), F.mse_loss).reshape(1)
        opt.step()
        opt.zero_grad()
        mesh["dp"].all_reduce(loss)
        losses.append(loss.item() / 2)
    return {"losses": losses, "state": model.full_state_dict(), "stats": opt.statistics}


def test_compression_acts_on_each_stage_dp_group() -> None:
    results = run_world(4, _compressed, "dense", timeout=60)
    assert worst_error(results, reference("mlp", "sgd", 16)) <= 1e-5
    sparse = run_world(4, _compressed, "topka", timeout=60)
    assert all(r["stats"]["local_density"] == pytest.approx(0.25, abs=0.02) for r in sparse)


class _ScaleFn(torch.autograd.Function):
    """y = x * w (w a vector); its weight-gradient goes through weight_gradient_queue and
    defer_weight_gradient (the extension point for custom layers under zero-bubble)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, log: list[str], queue: Any) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.log, ctx.queue = w, log, queue
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        from dtlab.models.pipeline import defer_weight_gradient

        (x,) = ctx.saved_tensors
        w = ctx.w

        def weight_grad() -> None:
            ctx.log.append("W")
            gw = (g * x).reshape(-1, x.shape[-1]).sum(0)
            w.grad = gw if w.grad is None else w.grad.add_(gw)

        ctx.log.append("I")
        defer_weight_gradient(weight_grad, ctx.queue)
        return g * w, None, None, None


class _Scale(nn.Module):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.w, self.log = nn.Parameter(torch.linspace(0.5, 1.5, 6)), log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dtlab.models.pipeline import weight_gradient_queue

        return _ScaleFn.apply(x, self.w, self.log, weight_gradient_queue(x))


def _custom(b: Any, schedule: str) -> dict[str, Any]:
    log: list[str] = []
    model = PipelineParallelModel(
        nn.Sequential(_Scale(log), nn.Tanh(), _Scale(log)), b, schedule, micro_batches=2
    )
    xs, ys = mlp_data(4)
    model.train_step((xs[0], ys[0]), F.mse_loss)
    return {"grads": {n: p.grad.clone() for n, p in model.module.named_parameters()}, "log": "".join(log)}


def test_custom_functions_defer_their_weight_gradient() -> None:
    log: list[str] = []
    plain = nn.Sequential(_Scale(log), nn.Tanh(), _Scale(log))
    xs, ys = mlp_data(4)
    F.mse_loss(plain(xs[0]), ys[0]).backward()
    assert log == ["I", "W", "I", "W"]  # outside a pipeline: at once
    for schedule in ("1f1b", "zero_bubble"):
        results = run_world(2, _custom, schedule, timeout=30)
        for res in results:
            for name, g in res["grads"].items():
                torch.testing.assert_close(g, plain.get_parameter(name).grad, rtol=1e-6, atol=1e-7)
        # zero-bubble: the last stage (rank 1) runs I0 I1 then both W; 1F1B runs each at once
        assert results[1]["log"] == ("IWIW" if schedule == "1f1b" else "IIWW"), (schedule, results[1]["log"])


def _autocast_stages(backend: Any) -> tuple[float, torch.Tensor]:
    """Stages that end in a Linear: under bf16 autocast each sends a bf16 output, the spec is float32."""
    net = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))
    model = PipelineParallelModel(net, Mesh(backend, {"pp": 2}), "1f1b", micro_batches=2)
    xs, ys = mlp_data(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.train_step((xs[0], ys[0]), lambda out, y: F.mse_loss(out.float(), y))
        model.eval()
        with torch.no_grad():
            out = model(xs[0])
    return float(loss), out


def test_autocast_outputs_cross_stages_in_the_spec_dtype() -> None:
    (l0, o0), (l1, o1) = run_world(2, _autocast_stages, timeout=60)
    assert l0 == l1 and torch.isfinite(torch.tensor(l0))
    assert o0.dtype == torch.float32 and torch.equal(o0, o1)
