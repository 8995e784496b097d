"""A training loop's mistakes around a pipeline's train_step that one process answers with an error
(``loss.backward()`` on a loss without a graph): refused naming the cause, never a step that trains
nothing or a refusal that blames the parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import make_mlp, mlp_data
from torch import nn

from dtlab.backends import Mesh
from dtlab.config import load_config
from dtlab.core.rng import seeded_init
from dtlab.data import TensorDataset
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import PipelineParallelModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world
from dtlab.trainers import run_training


def refusal(fn: Any, *args: Any) -> BaseException:
    with pytest.raises(RankFailedError) as info:
        run_world(2, fn, *args, timeout=30)
    assert info.value.__cause__ is not None
    return info.value.__cause__


def test_train_step_under_no_grad_is_refused_on_every_rank() -> None:
    def step(backend: Any) -> str:
        model = PipelineParallelModel(make_mlp(), backend, "1f1b", micro_batches=2)
        x, y = (t[0] for t in mlp_data(4))
        try:
            with torch.no_grad():  # an evaluation loop calling train_step
                model.train_step((x, y), F.mse_loss)
        except StrategyError as exc:
            return str(exc)
        return "trained"

    for said in run_world(2, step, timeout=30):  # before the schedule: no rank left waiting
        assert "PipelineParallelModel.train_step under torch.no_grad() (or inference_mode)" in said


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("find_unused", [False, True])
def test_a_loss_without_a_graph_is_refused_on_every_rank(find_unused: bool, dp: int) -> None:
    """With find_unused_parameters every parameter was left out of the step: nothing trained, silently.
    The refusal came from the last stage's rank alone: the first stage's waited in the step's all-reduce
    ('rank(s) [1] of this group already returned without reaching it'; a dead peer on a real engine)."""

    def step(backend: Any) -> str:
        unused = {"find_unused_parameters": find_unused}
        mesh = Mesh(backend, {"pp": 2, "dp": dp})
        model = PipelineParallelModel(make_mlp(), mesh, micro_batches=2, **unused)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        x, y = (t[0] for t in mlp_data(4))
        try:
            model.train_step((x, y), lambda out, t: F.mse_loss(out.detach(), t))
        except StrategyError as exc:
            return str(exc)
        opt.step()
        return "trained"

    says = "loss_fn returned a loss that does not require grad from an output that does, for every micro"
    for said in run_world(2 * dp, step, timeout=30):
        assert says in said


def test_a_replica_whose_losses_have_no_graph_trains_beside_one_whose_do() -> None:
    """With find_unused_parameters, a replica with nothing to learn in any micro-batch (a constant loss:
    all its targets ignored) leaves its share out, as one process's zero gradient for it; refused only
    where every replica's loss has no graph."""

    def step(backend: Any) -> str:
        mesh = Mesh(backend, {"pp": 2, "dp": 2})
        model = PipelineParallelModel(make_mlp(), mesh, micro_batches=2, find_unused_parameters=True)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        x, y = (t[0] for t in mlp_data(4))
        nothing = mesh.coordinate("dp") == 1
        model.train_step((x, y), lambda out, t: torch.zeros(()) if nothing else F.mse_loss(out, t))
        opt.step()
        return "trained"

    assert run_world(4, step, timeout=30) == ["trained"] * 4


def test_a_step_after_train_steps_inside_no_sync_only_names_train_step() -> None:
    """It said 'call loss.backward() outside no_sync()', which a pipeline's loop never calls."""

    def step(backend: Any) -> None:
        model = PipelineParallelModel(make_mlp(), backend, micro_batches=2)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        with model.no_sync():
            model.train_step(tuple(t[0] for t in mlp_data(4)), F.mse_loss)
        opt.step()

    err = refusal(step)
    assert isinstance(err, StrategyError) and "found no synchronized gradients" in str(err)
    assert "under a pipeline model.train_step(batch, loss_fn)) outside no_sync()" in str(err)


@pytest.mark.parametrize(
    ("returns", "says"),
    [
        ("dict", "got {'loss': <Tensor>}; return the loss alone"),
        ("tuple", "got a tuple of 2 items: (<Tensor>, {'acc': 0.5}); return the loss alone"),
        ("number", "a Python number has no gradient: return the tensor, not loss.item()"),
        ("vector", "got a torch.float32 tensor of shape (4,)"),
    ],
)
def test_a_loss_fn_returning_other_than_a_scalar_tensor_is_named(returns: str, says: str) -> None:
    """It said 'got dict ()', 'got tuple ()', 'got float ()'."""

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> Any:
        loss = F.mse_loss(out, target)
        return {
            "dict": {"loss": loss},
            "tuple": (loss, {"acc": 0.5}),
            "number": loss.item(),
            "vector": (out - target).pow(2).mean(1),
        }[returns]

    def step(backend: Any) -> None:
        model = PipelineParallelModel(make_mlp(), backend, micro_batches=2)
        model.train_step(tuple(t[0] for t in mlp_data(8)), loss_fn)

    err = refusal(step)
    assert isinstance(err, StrategyError) and "loss_fn must return a scalar tensor" in str(err)
    assert says in str(err)


def test_a_constant_loss_for_one_micro_batch_leaves_it_out_as_zero() -> None:
    """A loss_fn returning a constant for a micro-batch with nothing to learn (all its targets
    ignored) skips that micro-batch's backward, as its zero gradient: only a step where every
    micro-batch's loss has no graph is refused."""

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.zeros(()) if bool((target == 0).all()) else F.mse_loss(out, target)

    x, y = (t[0].clone() for t in mlp_data(4))
    y[:2] = 0  # the first micro-batch has nothing to learn

    def step(backend: Any) -> dict[str, torch.Tensor]:
        model = PipelineParallelModel(make_mlp(), backend, micro_batches=2)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        model.train_step((x, y), loss_fn)
        opt.step()
        return model.full_state_dict()

    ref = make_mlp()
    (F.mse_loss(ref(x[2:]), y[2:]) / 2).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for state in run_world(2, step, timeout=30):
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_trainer_leaves_out_a_micro_batch_with_a_constant_loss_as_the_pipeline_does() -> None:
    """Through the Trainer (run_training, pp = 2) a loss_fn returning torch.zeros(()) for a micro-batch
    whose targets are all ignored stopped the run with a ConfigError on the last stage's rank only; the
    pipeline leaves such a micro-batch out (its zero gradient): the same losses as a zero with a graph."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = (x @ torch.tensor([1.0, -2.0, 0.5, 1.0]) > 0).long()
    y = torch.where(torch.rand(256, generator=g) < 0.5, y, torch.full_like(y, -100))  # half ignored
    with seeded_init(0):
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    constant: list[int] = []

    def loss_fn(with_graph: bool) -> Any:
        def fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if bool((target == -100).all()):  # nothing to learn in this micro-batch
                constant.append(target.numel())  # 4: a training micro-batch (not the 2-sample preflight)
                return out.sum() * 0 if with_graph else torch.zeros(())
            return F.cross_entropy(out, target, ignore_index=-100)

        return fn

    sets = ["backend.name=inmemory", "backend.world_size=2", "parallel.pp=2", "parallel.micro_batches=2"]
    sets += ["data.global_batch_size=8", "train.steps=20", "train.eval_every=0", "logging.progress=false"]
    cfg = load_config(overrides=[*sets, "logging.run_dir=null", "optimizer.warmup_steps=0"])
    data = TensorDataset(x, y)
    losses = [
        run_training(cfg, model=net, train_data=data, loss_fn=loss_fn(g))[0].losses for g in (False, True)
    ]
    assert 4 in constant and len(losses[0]) == 20 and losses[0] == losses[1]
