"""Habits of torch.distributed.pipelining and Megatron users under a pipeline, against one plain
process on the same global batch (in-memory ranks, tiny models)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from hf_cases import llama, token_batch
from torch import nn

from dtlab.backends import Mesh
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, PipelineParallelModel
from dtlab.models.checkpointing import checkpoint_modules
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS = 3


CLIP = 0.5


class _Wrap(nn.Module):
    """A block around a layer that another block wraps too (the layer shared, not its weights)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _Blocks(nn.Sequential):
    """Its ``pipeline_blocks()`` name the first layer again as the last block."""

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        return [*((str(i), b) for i, b in enumerate(self)), ("again", self[0])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[0](super().forward(x))


def _used_twice(kind: str) -> nn.Sequential:
    """Linear ``a`` applied first and last, across the stage boundary: as the same child of the
    ``nn.Sequential`` twice, inside two wrapper blocks, or as two of the ``pipeline_blocks()``."""
    a = nn.Linear(6, 6)
    mid = [nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()]
    if kind == "blocks":
        return filled(_Blocks(a, *mid), 0, scale=0.5)
    blocks = [a, *mid, a] if kind == "same_child" else [_Wrap(a), *mid, _Wrap(a)]
    return filled(nn.Sequential(*blocks), 0, scale=0.5)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 8, 6, generator=g), torch.randn(STEPS, 8, 6, generator=g)


def _one_process(kind: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model = _used_twice(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = _data()
    losses, norms = [], []
    for s in range(STEPS):
        loss = F.mse_loss(model(xs[s]), ys[s])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipelined(backend: Any, kind: str, dp: str, axes: dict[str, int]) -> tuple[list[float], ...]:
    mesh = Mesh(backend, axes)
    sharded: dict[str, Any] = {"persistence_threshold": 0} if dp == "zero3" else {}
    model = HybridShardedModel(_used_twice(kind), mesh, dp, micro_batches=2, split_points=["3"], **sharded)
    driver = ZeRO3Optimizer if dp in ("zero3", "fsdp") else DDPOptimizer
    opt = driver(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    xs, ys = _data()
    share = 8 // mesh.size("dp")
    part = slice(mesh.coordinate("dp") * share, (mesh.coordinate("dp") + 1) * share)
    losses, norms = [], []
    for s in range(STEPS):
        losses.append(float(model.train_step((xs[s][part], ys[s][part]), F.mse_loss)))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    return losses, norms, model.full_state_dict()


@pytest.mark.parametrize("kind", ["same_child", "wrapped", "blocks"])
@pytest.mark.parametrize(("dp", "axes"), [("ddp", {"pp": 2}), ("zero3", {"pp": 2, "dp": 2})])
def test_a_layer_applied_in_two_stages_trains_as_one_process(kind: str, dp: str, axes: dict) -> None:
    """A layer ``a`` applied first and last, split between two pipeline ranks, clipped: the second
    ``a`` of ``nn.Sequential(a, ..., a)`` was dropped from the stages (``named_children`` lists a child
    once: loss 0.885 against one process's 1.060), and ``a`` in two wrapper blocks or twice among the
    ``pipeline_blocks()`` ran on both ranks with each rank's part of its gradient (1.07 relative
    error; norm 0.723 for 0.756). Now ``a`` is tied across the stages, as a weight shared between two
    layers, and counted once in the norm."""
    want_losses, want_norms, want = _one_process(kind)
    results = run_world(2 * axes.get("dp", 1), _pipelined, kind, dp, axes, timeout=60)
    means = [sum(r[0][s] for r in results) / len(results) for s in range(STEPS)]  # each dp share's mean
    assert means == pytest.approx(want_losses, rel=1e-5)
    for _, norms, state in results:
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert state.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


class _DictOut(nn.Module):
    """A model without blocks returning ``{"logits": ...}`` (split at module names)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.b(torch.tanh(self.a(x)))}


def _infer(backend: Any, kind: str, x: torch.Tensor) -> Any:
    with seeded_init(0):
        net = llama(layers=2) if kind == "llama" else _DictOut()
    points = ["model.layers.1"] if kind == "llama" else ["b"]
    model = PipelineParallelModel(net, backend, micro_batches=2, split_points=points)
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("kind", ["llama", "dict"])
def test_inference_of_a_model_split_at_module_names_gives_the_plain_models_output(kind: str) -> None:
    """``out = model(input_ids); out.logits`` or ``out[0]`` under a pipeline: the output was the
    logits tensor, so ``.logits`` raised torch's AttributeError and ``out[0]`` was silently the first
    sample's logits ((8, 32) for (4, 8, 32)). Now it is the plain model's output class around the logits."""
    if kind == "llama":
        x = token_batch(4, seed=1)[0]
        with seeded_init(0):
            plain = llama(layers=2).eval()
    else:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        with seeded_init(0):
            plain = _DictOut()
    with torch.no_grad():
        want = plain(x)
    for out in run_world(2, _infer, kind, x, timeout=60):
        assert type(out) is type(want)
        torch.testing.assert_close(out["logits"], want["logits"], rtol=1e-6, atol=1e-6)
        if kind == "llama":
            assert out[0].shape == want[0].shape
            torch.testing.assert_close(out.logits, want.logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("n_microbatches", "pass micro_batches="),
        ("loss_fn", r"model.train_step\(\(inputs, targets\), loss_fn\)"),
        ("scale_grads", r"divides each micro-batch's loss by micro_batches \(torch's scale_grads=True\)"),
        ("split_spec", "pass split_points="),
    ],
)
def test_torch_pipelining_arguments_are_named_with_dtlabs_way(name: str, says: str) -> None:
    """``PipelineParallelModel(net, mesh, n_microbatches=4)`` (torch's ScheduleGPipe argument) was
    refused as 'ZeRO1Model(n_microbatches=...): n_microbatches= is not one of its options', naming
    the data-parallel strategy the composition builds and no fix."""

    def build(backend: Any) -> None:
        PipelineParallelModel(_used_twice("same_child"), backend, **{name: 4})

    with pytest.raises(RankFailedError) as info:
        run_world(1, build, timeout=20)
    error = info.value.__cause__
    assert isinstance(error, TypeError)
    assert str(error).startswith(f"PipelineParallelModel({name}=...): torch.distributed.pipelining's")
    assert re.search(says, str(error))


def _sharded_by_global_rank(backend: Any, kind: str) -> str:
    """pp 2 x dp 2, each rank given its own quarter of the batch (torch DDP's
    ``DistributedSampler(ds, num_replicas=world_size, rank=rank)``): the refusal on this rank."""
    mesh = Mesh(backend, {"pp": 2, "dp": 2})
    model = PipelineParallelModel(_used_twice("wrapped"), mesh, micro_batches=2)
    DDPOptimizer(model, torch.optim.SGD, lr=0.1)
    xs, ys = _data()
    mine = slice(2 * backend.rank, 2 * backend.rank + 2)
    try:
        if kind == "train_step":
            model.train_step((xs[0][mine], ys[0][mine]), F.mse_loss)
        else:
            model.eval()
            with torch.no_grad():
                model(xs[0][mine])
    except StrategyError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("kind", ["train_step", "inference"])
def test_pipeline_ranks_given_other_batches_are_refused_on_every_rank(kind: str) -> None:
    """Data sharded by the global rank gave each pipeline rank of a replica its own batch: the first
    stage read one batch's inputs and the last stage another's targets, and trained on them silently
    (loss 0.481 for the pair); inference gave every rank the first stage's output. Now the first step
    and the first inference compare the pp ranks' batches (one all-reduce of 6 int64 over pp)."""
    for rank, said in enumerate(run_world(4, _sharded_by_global_rank, kind, timeout=60)):
        what = "batches" if kind == "train_step" else "inputs"
        assert f"the ranks of a pipeline were given different {what}" in said, (rank, said)
        assert "pp rank 1 (world rank 2" in said or "pp rank 1 (world rank 3" in said, said
        assert "sharding the data by the dp coordinate, not by the global rank" in said


def _normed() -> nn.Sequential:
    layers = [
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 6),
    ]
    return filled(nn.Sequential(*layers), 0, scale=0.5)


class _Tracked(nn.Module):
    """A linear layer keeping statistics of its inputs in forward: a count updated in place and an
    exponential moving average assigned anew (as a router's load or a running normalizer keeps them),
    its input centred by the updated average (the output depends on what the forward updated)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen += x.shape[0]
                self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        return self.lin(x - self.ema)


def _tracked() -> nn.Sequential:
    layers = [nn.Linear(6, 6), nn.Tanh(), _Tracked(), nn.Tanh(), nn.Linear(6, 6)]
    return filled(nn.Sequential(*layers), 0, scale=0.5)


def _micro_batches_in_turn(model: nn.Module) -> dict[str, torch.Tensor]:
    """One process running each step's two micro-batches in turn (as a pipeline of 2 micro-batches)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _data()
    for s in range(STEPS):
        for x, y in zip(xs[s].chunk(2), ys[s].chunk(2), strict=True):
            (F.mse_loss(model(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _normed_pipelined(backend: Any, checkpointing: bool, make: Any = _normed) -> dict[str, torch.Tensor]:
    model = PipelineParallelModel(make(), backend, micro_batches=2, activation_checkpointing=checkpointing)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
    xs, ys = _data()
    for s in range(STEPS):
        model.train_step((xs[s], ys[s]), F.mse_loss)
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def test_checkpointed_stages_update_batchnorm_statistics_once_per_micro_batch() -> None:
    """A checkpointed stage recomputes its forward in backward, and BatchNorm's recomputed forward
    updated the running statistics a second time (num_batches_tracked 2 per micro-batch; running mean
    0.031 off after one step). Now the recompute leaves them as it found them: the same statistics and
    parameters as one process running the micro-batches in turn (a pipeline's BatchNorm normalizes
    each micro-batch on its own)."""
    want = _micro_batches_in_turn(_normed())
    for checkpointing in (False, True):
        for state in run_world(2, _normed_pipelined, checkpointing, timeout=60):
            assert int(state["1.num_batches_tracked"]) == 2 * STEPS
            for name, value in want.items():
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_modules_updates_batchnorm_statistics_once() -> None:
    """``checkpoint_modules`` (``strategy.activation_checkpointing``) on a module holding a BatchNorm:
    its recomputed forward in backward updated the running statistics again (num_batches_tracked 2
    per step). Now as without the checkpoint, bitwise."""
    plain, checkpointed = _normed(), _normed()
    assert checkpoint_modules(checkpointed, (nn.BatchNorm1d,)) == 2
    xs, ys = _data()
    for model in (plain, checkpointed):
        F.mse_loss(model(xs[0]), ys[0]).backward()
    want = plain.state_dict()
    assert int(checkpointed.state_dict()["1.num_batches_tracked"]) == 1
    for name, value in checkpointed.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_checkpointed_stages_update_buffers_of_their_own_once() -> None:
    """A buffer a module updates in its forward other than BatchNorm's (a count in place, a moving
    average assigned anew) was updated again by the recomputation in backward: the count twice one
    process's, the average 0.57 off after 5 steps, under per-stage checkpointing and checkpoint_modules.
    Now as without the checkpoint. The recomputation also starts from the buffers the forward found:
    it centred its input by the twice-updated average (5.7e-2 relative error on the layer's weight
    gradient), so the parameters drifted from one process's."""
    want = _micro_batches_in_turn(_tracked())
    xs, ys = _data()
    for state in run_world(2, _normed_pipelined, True, _tracked, timeout=60):
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    plain, checkpointed = _tracked(), _tracked()
    checkpoint_modules(checkpointed, (_Tracked,))
    for module in (plain, checkpointed):
        F.mse_loss(module(xs[0]), ys[0]).backward()
    for name, value in checkpointed.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


def _module_called(backend: Any, form: str) -> str:
    model = PipelineParallelModel(_used_twice("wrapped"), backend, micro_batches=2)
    model.eval()
    x = _data()[0][0]
    try:
        with torch.no_grad():
            model.module(x) if form == "x" else model.module(x, attention_mask=torch.ones(8, 6))
    except StrategyError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("form", ["x", "keyword"])
def test_calling_model_module_under_a_pipeline_names_the_fix(form: str) -> None:
    """``model.module(x)`` (torch DDP's habit for a forward without the wrapper) under a pipeline
    stopped with Python's 'StageRoot.forward() missing 1 required positional argument: 'stage''."""
    for said in run_world(2, _module_called, form, timeout=30):
        assert said.startswith("model.module under a pipeline is this rank's pipeline stages"), said
        assert "call model(x)" in said and "model.train_step((inputs, targets), loss_fn)" in said
