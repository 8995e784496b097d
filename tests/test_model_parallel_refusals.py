"""What the pipeline and the model-parallel composition refuse, each through the public API (no
communication, or in-memory ranks and tiny models): the error class, the value and the fix named; and
the local hand-over between two stages of one rank (pp = 1, interleaved 1F1B) against plain training,
for a split at blocks and one at module names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import make_mlp, mlp_data, pipeline_rank, reference, worst_error
from torch import nn

from dtlab.backends import Mesh
from dtlab.core.plan import RunPlan
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, PipelineParallelModel, TensorParallelModel, transformer_plan
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world
from dtlab.trainers.models import TransformerLM

WIDTH = 4


def refusal(n: int, fn: Callable[..., Any], *args: Any) -> BaseException:
    """What rank 0 of an in-memory world of ``n`` ranks raised running ``fn``."""
    with pytest.raises(RankFailedError) as info:
        run_world(n, fn, *args, timeout=30)
    cause = info.value.__cause__
    assert cause is not None
    return cause


def one_rank_pipeline(module: nn.Module, backend: Any, split_points: list[str] | None = None) -> Any:
    """Two stages on one rank: no communication, every split and trace check still made."""
    return PipelineParallelModel(
        module, backend, "interleaved_1f1b", micro_batches=2, split_points=split_points, stages_per_rank=2
    )


def batch(rows: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def linear(seed: int) -> nn.Linear:
    with seeded_init(seed):
        return nn.Linear(WIDTH, WIDTH)


# ------------------------------------------------------------------------------------ blocks
class _Blocks(nn.Module):
    """A module with pipeline_blocks() returning ``pairs`` (built from its two layers)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.a, self.b = kind, linear(0), linear(1)

    def pipeline_blocks(self) -> list[tuple[str, Any]]:
        if self.kind == "empty":
            return []
        if self.kind == "same_name":
            return [("layer", self.a), ("layer", self.b)]
        return [("a", self.a), ("act", torch.tanh), ("b", self.b)]


class _Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)

    def forward(self, x: torch.Tensor) -> Any:
        return self.lstm(x)  # (output, (h, c)): not one tensor


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (nn.Sequential, ["Sequential has no blocks to split", "give it its layers as blocks"]),
        (lambda: _Blocks("empty"), ["_Blocks has no blocks", "pipeline_blocks() returned nothing"]),
        (lambda: _Blocks("same_name"), ["['layer', 'layer'] (['layer'] more than once)", "its own name"]),
        (lambda: _Blocks("function"), ["block 'act' is a builtin_function_or_method", "wrap it in a module"]),
    ],
)
def test_refused_blocks(make: Callable[[], nn.Module], words: list[str]) -> None:
    err = refusal(1, lambda b: one_rank_pipeline(make(), b))
    assert isinstance(err, StrategyError) and all(w in str(err) for w in words), err


def test_a_block_returning_several_values_is_refused_at_the_first_step() -> None:
    def body(b: Any) -> None:
        model = one_rank_pipeline(nn.Sequential(nn.Linear(WIDTH, WIDTH), _Lstm()), b)
        x, y = batch()
        model.train_step((x.reshape(4, 1, WIDTH), y.reshape(4, 1, WIDTH)), F.mse_loss)

    err = refusal(1, body)
    assert isinstance(err, StrategyError)
    assert "pipeline stage 1 (1) returns a tuple" in str(err) and "lstm(x)[0]" in str(err)


# ------------------------------------------------------------------------------ module names
class _Net(nn.Module):
    """Split at module names: ``emb``, ``layers.0..2``, ``head``; ``order`` says how the forward calls
    them (each case a user's forward the split cannot follow)."""

    def __init__(self, order: str = "plain") -> None:
        super().__init__()
        self.order = order
        self.emb = linear(0)
        self.layers = nn.ModuleList([linear(i + 1) for i in range(3)])
        self.head = linear(9)

    def forward(self, x: torch.Tensor) -> Any:
        emb, (l0, l1, l2), head = self.emb, self.layers, self.head
        if self.order == "reversed":  # layers.1 (stage 1) before emb (stage 0)
            return head(l2(l0(emb(l1(x)))))
        if self.order == "skips":  # never calls layers.1
            return head(l2(l0(emb(x))))
        if self.order == "tuple_out":
            return (head(l2(l1(l0(emb(x))))),)
        if self.order == "residual":  # the output adds emb's output, from stage 0
            e = emb(x)
            return head(l2(l1(l0(e)))) + e
        if self.order == "late_first":  # layers.2 (stage 1) before the split point layers.1
            return head(l1(l2(l0(emb(x)))))
        if self.order == "weights":  # reads a weight's value: zero weights break it
            scale = torch.linalg.cholesky(emb.weight @ emb.weight.T)
            return head(l2(l1(l0(emb(x) @ scale))))
        if self.order == "by_input" and x[0, 0] > 0:  # skips the split point on some inputs
            return l0(emb(x))
        # a keyword argument at the split point, and an attribute of a block read by the glue
        h = l1(input=l0(emb(x)) * (l1.out_features / WIDTH))
        return head(l2(h))


class _ListArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = linear(5)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.inner(xs[0])
        return out


class _NetWithList(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = _ListArg()

    def forward(self, x: torch.Tensor) -> Any:
        l0, l1, l2 = self.layers
        return self.head(l2(l1([l0(self.emb(x))])))


@pytest.mark.parametrize(
    ("points", "words"),
    [
        (("layers",), "split points ['layers'] are containers of _Net (nn.ModuleList or nn.ModuleDict)"),
        (("layers",), "split at one of their items, e.g. ['layers.0', 'layers.1', 'layers.2']"),
        (("layers.2", "layers.1"), "are not in the order of _Net's modules; give them in that order"),
    ],
)
def test_split_points_refused_by_check_plan(points: tuple[str, ...], words: str) -> None:
    """``HybridShardedModel.check_plan`` checks module names without communication."""
    with pytest.raises(StrategyError) as info:
        HybridShardedModel.check_plan(_Net(), RunPlan(pp=len(points) + 1, split_points=points))
    assert words in str(info.value)


def test_nested_split_points_refused() -> None:
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.body = linear(0), nn.Sequential(linear(1), linear(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.body(self.a(x))
            return out

    with pytest.raises(StrategyError, match=r"none inside another: got \['body', 'body.1'\] \(\['body'\]"):
        HybridShardedModel.check_plan(Nested(), RunPlan(pp=3, split_points=("body", "body.1")))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda: _Net("reversed"),
            "calls 'emb' (pipeline stage 0) after 'layers.1' (stage 1): the split points do not follow "
            "the forward's order. Choose split points in call order",
        ),
        (
            lambda: _Net("reversed"),
            "the model registers 'emb' before split point 'layers.1' and calls it after",
        ),
        (lambda: _Net("skips"), "_Net's forward never calls split points ['layers.1']; split at modules it"),
        (lambda: _Net("tuple_out"), "_Net returns a tuple; a pipeline's last stage needs a tensor or an"),
        (
            lambda: _Net("residual"),
            "pipeline stage 1's output is computed from 'emb', a block of an earlier stage; split elsewhere",
        ),
        (
            lambda: _Net("late_first"),
            "stage 0 ended at 'layers.2' with Tensor, expected split point 'layers.1' with a tensor: the "
            "forward calls 'layers.2', a block of a later stage, before 'layers.1'; split at",
        ),
        (
            lambda: _Net("weights"),
            "_Net's forward could not be traced with zero weights on input (2, 4) torch.float32",
        ),
        (_NetWithList, "split point 'layers.1' is called without a tensor argument (the hidden state"),
    ],
)
def test_forwards_the_trace_refuses(make: Callable[[], nn.Module], words: str) -> None:
    """The trace before the first step (a split at module names, two stages on one rank)."""

    def body(b: Any) -> None:
        model = one_rank_pipeline(make(), b, ["layers.1"])
        model.train_step(batch(), F.mse_loss)

    err = refusal(1, body)
    assert isinstance(err, StrategyError) and words in str(err), err


def test_a_forward_skipping_the_split_point_on_some_input_is_refused_when_it_does() -> None:
    def body(b: Any) -> None:
        model = one_rank_pipeline(_Net("by_input"), b, ["layers.1"])
        x, y = batch()
        model.train_step((-x.abs(), y), F.mse_loss)  # traced on this shape: calls layers.1
        model.train_step((x.abs(), y), F.mse_loss)

    err = refusal(1, body)
    assert isinstance(err, StrategyError)
    assert "the model's forward returned without calling split point 'layers.1' on this input" in str(err)


# ------------------------------------------------------------------ the local hand-over (pp = 1)
def test_two_stages_on_one_rank_train_as_one_process() -> None:
    """Interleaved 1F1B at pp = 1, stages_per_rank = 2: each stage hands its output (forward) and its
    input's gradient (backward) to the other one locally, no communication."""
    (r,) = run_world(1, pipeline_rank, "mlp", {"pp": 1}, "interleaved_1f1b", 4, "sgd", 16, 2, timeout=60)
    assert worst_error([r], reference("mlp", "sgd", 16)) <= 1e-5

    def split_at_names(b: Any) -> tuple[list[float], dict[str, torch.Tensor], int]:
        model = one_rank_pipeline(_Net(), b, ["layers.1"])
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        losses = []
        for s in range(3):
            losses.append(model.train_step(batch(seed=s), F.mse_loss).item())
            opt.step()
            opt.zero_grad()
        return losses, model.full_state_dict(), len(model.last_timeline())

    (losses, state, actions), plain = run_world(1, split_at_names, timeout=60)[0], _Net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for s, got in enumerate(losses):
        x, y = batch(seed=s)
        loss = F.mse_loss(plain(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert got == pytest.approx(loss.item(), rel=1e-6)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7)
    assert actions == 2 * 2 * 2  # 2 stages x 2 micro-batches x (forward, backward)


# -------------------------------------------------------------------------------- composition
def test_refused_modules_meshes_and_batches() -> None:
    err = refusal(1, lambda b: HybridShardedModel("net", Mesh(b, {"dp": 1})))  # type: ignore[arg-type]
    assert isinstance(err, TypeError) and "HybridShardedModel wraps a torch.nn.Module, got str" in str(err)

    err = refusal(2, lambda b: PipelineParallelModel(make_mlp(), Mesh(b, {"pp": 1, "tp": 2})))
    assert isinstance(err, StrategyError)
    assert "on the mesh axes pp, dp; this mesh also has ['tp=2'] (HybridShardedModel composes" in str(err)

    err = refusal(1, lambda b: HybridShardedModel(make_mlp(), Mesh(b, {"dp": 1}), split_points=["2"]))
    assert isinstance(err, StrategyError)
    assert "split_points=['2'] need a pipeline (pp > 1 or stages_per_rank > 1)" in str(err)

    def list_batch(b: Any) -> None:
        x, y = mlp_data(4)
        PipelineParallelModel(make_mlp(), b, micro_batches=2).train_step((list(x[0]), y[0]), F.mse_loss)

    err = refusal(1, list_batch)
    assert isinstance(err, StrategyError)
    says = "PipelineParallelModel.train_step: inputs must be a batched tensor, got a list of 4 items: ["
    assert says in str(err)


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ("three", "batch must be the pair (inputs, targets), got a tuple of 3 items"),  # was a raw ValueError
        ("dict", "batch must be the pair (inputs, targets), got a dict of 2 entries: {'inputs': <Tensor>"),
        ("dict inputs", "inputs must be a batched tensor, got a dict of 2 entries: {'ids': <Tensor>"),
        ("tuple targets", "targets must be a batched tensor, got (<Tensor>, <Tensor>); a pipeline feeds"),
        ("scalar targets", "targets must be a batched tensor, got a torch.float32 tensor of shape ()"),
    ],
)
def test_a_batch_a_pipeline_cannot_take_is_named_with_the_fix(form: str, says: str) -> None:
    """A mask travelling with the inputs, a dict batch: one clear refusal, never a raw traceback."""

    def step(b: Any) -> None:
        x, y = (t[0] for t in mlp_data(4))
        batch: Any = {
            "three": (x, x > 0, y),
            "dict": {"inputs": x, "targets": y},
            "dict inputs": ({"ids": x, "mask": x > 0}, y),
            "tuple targets": (x, (y, x)),
            "scalar targets": (x, y.sum()),
        }[form]
        PipelineParallelModel(make_mlp(), b, micro_batches=2).train_step(batch, F.mse_loss)

    err = refusal(2, step)
    assert isinstance(err, StrategyError) and says in str(err)
    assert "tensor([" not in str(err)  # the values are not dumped
    assert "one tensor crosses each stage boundary" in str(err)


def test_from_plan_meshes_and_tensor_plans() -> None:
    with pytest.raises(TypeError, match=r"from_plan takes a Mesh .* or a backend, got str"):
        HybridShardedModel.from_plan(_Net(), "dp=2", RunPlan())  # type: ignore[arg-type]
    with pytest.raises(StrategyError, match=r"pattern 'layer' matches no module of _Net .* \['emb', 'lay"):
        HybridShardedModel.check_plan(_Net(), RunPlan(tp=2, tensor_plan={"layer": "colwise"}))

    def on_a_mesh(b: Any) -> tuple[dict[str, int], str]:
        model = HybridShardedModel.from_plan(make_mlp(), Mesh(b, {"dp": 2}), RunPlan("zero1"))
        return dict(model.mesh.shape), model.data_parallel

    assert run_world(2, on_a_mesh, timeout=30) == [({"dp": 2}, "zero1")] * 2  # the mesh given, used


def test_sequence_parallel_refuses_a_step_on_stale_gradients() -> None:
    def body(b: Any) -> None:
        with seeded_init(0):
            net = TransformerLM(d_model=16, n_layers=1, n_heads=2, seq_len=8)
        model = TensorParallelModel(net, Mesh(b, {"tp": 2}), transformer_plan(sequence_parallel=True))
        DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        tokens = torch.arange(32).reshape(4, 8) % 64
        for _ in range(2):  # no opt.zero_grad() between the steps
            model.cross_entropy(model(tokens), tokens).backward()

    err = refusal(2, body)
    assert isinstance(err, StrategyError)
    assert "a synchronized step started while the gradients of the last one are still there" in str(err)
    assert "call opt.zero_grad() between steps" in str(err)
