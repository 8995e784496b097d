"""A resumed run equals the uninterrupted one: the parts of the state whose restoring the other resume
tests do not reach (DataLoader workers' random draws mid-epoch), and what a resume cannot make equal
refused rather than changed silently (a torch scheduler's saved run length when train.steps changes);
in-memory ranks' dropout draws (threads sharing torch's global RNG) from generators of their own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint
from dtlab.checkpoint.consolidate import full_tensors_from_shards
from dtlab.config import TrainConfig, load_config
from dtlab.core.plan import RunPlan
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError
from dtlab.models import HybridShardedModel, get_model_strategy
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import Trainer, run_training
from dtlab.trainers.custom import task_from_objects
from dtlab.trainers.elastic import end_step
from dtlab.trainers.feed import DataFeed


class _Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample with fresh noise from the loading process's generator (a random augmentation)."""

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + torch.rand(3), torch.tensor(i)


def _batches(feed: DataFeed, steps: int) -> list[torch.Tensor]:
    return [x for _ in range(steps) for x, _ in feed.next_micro_batches()]


def test_a_workers_augmentation_resumed_mid_epoch_draws_what_the_uninterrupted_run_drew() -> None:
    data = _Augmented(40)  # 5 steps of 8 per epoch: 7 steps cross into the second epoch
    whole = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=2)
    first = _batches(whole, 3)
    saved = whole.state_dict()
    rest = _batches(whole, 4)
    for workers in (2, 1):  # the same draws with another number of workers
        again = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=workers)
        again.load_state_dict(saved)
        resumed = _batches(again, 4)
        assert all(torch.equal(a, b) for a, b in zip(resumed, rest, strict=True)), workers
    fresh = _batches(DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=1), 3)
    assert all(torch.equal(a, b) for a, b in zip(fresh, first, strict=True))
    assert (first[0] != first[0].round()).all()  # the noise was drawn


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    tiny = ["backend.name=inmemory", "backend.world_size=2", *TINY_LM, "train.eval_every=0"]
    return load_config(overrides=[*tiny, "logging.progress=false", f"logging.run_dir={tmp / 'run'}", *extra])


def _sequential(length: int) -> Callable[[torch.optim.Optimizer], Any]:
    def build(opt: torch.optim.Optimizer) -> Any:
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=1)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=length)
        return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[1])

    return build


def test_a_torch_schedulers_saved_length_is_not_kept_silently_when_train_steps_changes(
    tmp_path: Path,
) -> None:
    cosine = [
        "optimizer.schedule=torch",
        "optimizer.warmup_steps=0",
        "optimizer.torch_scheduler=CosineAnnealingLR",
    ]
    ck = tmp_path / "ck"
    run_training(_cfg(tmp_path, *cosine, "train.steps=3", f"checkpoint.dir={ck}", "checkpoint.every=2"))
    step2 = f"checkpoint.resume={ck / 'step_00000002'}"
    # train.steps 3 -> 6: the saved T_max=3 would have the rate climb back after step 3
    with pytest.raises(RankFailedError, match=r"CosineAnnealingLR has T_max=3, this run builds T_max=6 "
                       r"\(train.steps=3 when saved, 6 now\).*resume with train.steps=3.*"
                       r"optimizer.torch_scheduler_args=\{T_max: 3\}"):  # fmt: skip
        run_training(_cfg(tmp_path, *cosine, "train.steps=6", step2))
    pinned = "optimizer.torch_scheduler_args={T_max: 3}"  # the fix it names: the saved schedule goes on
    assert run_training(_cfg(tmp_path, *cosine, pinned, "train.steps=4", step2))[0].final_step == 4
    # a scheduler_factory's SequentialLR: the length of a part
    sk = tmp_path / "sk"
    cfg = _cfg(
        tmp_path, "optimizer.warmup_steps=0", "train.steps=3", f"checkpoint.dir={sk}", "checkpoint.every=2"
    )
    run_training(cfg, scheduler_factory=_sequential(2))
    again = _cfg(
        tmp_path, "optimizer.warmup_steps=0", "train.steps=3", f"checkpoint.resume={sk / 'step_00000002'}"
    )
    with pytest.raises(RankFailedError, match=r"SequentialLR has _schedulers\[1\].T_max=2, this run builds "
                       r"_schedulers\[1\].T_max=5; "):  # fmt: skip
        run_training(again, scheduler_factory=_sequential(5))
    assert run_training(again, scheduler_factory=_sequential(2))[0].final_step == 3


def _params(step_dir: Path) -> dict[str, torch.Tensor]:
    return full_tensors_from_shards(read_checkpoint(step_dir).model)


def test_dropout_on_in_memory_ranks_resumes_exactly_at_dp4_and_tp2(tmp_path: Path) -> None:
    # the ranks are threads sharing torch's global RNG: each draws from a generator of its own, saved
    for name, layout in (
        ("dp4", ["backend.world_size=4"]),
        ("tp2", ["backend.world_size=4", "parallel.tp=2"]),
    ):
        sets = [*layout, "model.dropout=0.2", "train.steps=4"]
        ck, again = tmp_path / name / "ck", tmp_path / name / "again"
        whole = run_training(_cfg(tmp_path, *sets, f"checkpoint.dir={ck}", "checkpoint.every=2"))[0].losses
        step2 = f"checkpoint.resume={ck / 'step_00000002'}"
        resumed = run_training(_cfg(tmp_path, *sets, f"checkpoint.dir={again}", step2))[0].losses
        assert resumed == whole[2:], name  # bitwise
        a, b = _params(ck / "step_00000004"), _params(again / "step_00000004")
        assert all(torch.equal(a[k], b[k]) for k in a), name
    undropped = run_training(_cfg(tmp_path, *layout, "train.steps=2"))[0].losses
    assert undropped != whole[:2]  # the masks were drawn


class _NativeDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.native_dropout(x, 0.5, True)[0])


def test_a_random_op_taking_no_generator_on_in_memory_ranks_is_refused_naming_the_fixes(
    tmp_path: Path,
) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    cfg = _cfg(tmp_path, "train.steps=1", "data.global_batch_size=8")
    with pytest.raises(RankFailedError, match=r"native_dropout.*takes no generator.*"
                       r"torch.nn.functional.dropout.*backend.name=gloo"):  # fmt: skip
        run_training(cfg, model=_NativeDropout, train_data=data, loss_fn="mse")


def test_a_resume_mid_epoch_with_another_shuffle_is_refused_at_an_epochs_end_allowed() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(40, 3), torch.arange(40))  # 5 steps of 8 an epoch
    feed = DataFeed(data, 8, 1, 0)
    _batches(feed, 3)
    unshuffled = DataFeed(data, 8, 1, 0, shuffle=False)
    with pytest.raises(ValueError, match=r"24 samples into epoch 0 of an order with data.shuffle=true, "
                       r"this run has data.shuffle=false.*resume with data.shuffle=true"):  # fmt: skip
        unshuffled.load_state_dict(feed.state_dict())
    _batches(feed, 2)  # the epoch's end: the next epoch may take another order
    unshuffled.load_state_dict(feed.state_dict())
    assert unshuffled.next_micro_batches()[0][1].tolist() == list(range(8))


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
        torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1),
    )  # fmt: skip


def _saved_and_rank0_buffers(backend: CommunicationBackend, strategy: str) -> tuple[Any, Any]:
    with seeded_init(0):
        module = _bn_net()
    if strategy == "ddp-pp2":
        model: Any = HybridShardedModel.from_plan(module, backend, RunPlan(pp=2))
    else:
        kwargs = {"persistence_threshold": 0} if strategy == "zero3" else {}
        model = get_model_strategy(strategy)(module, backend, **kwargs)
    g = torch.Generator().manual_seed(model.dp_backend.rank)  # each replica its batch, running statistics
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
    model.train_step((x, y), torch.nn.functional.mse_loss)
    mine = {n: b.clone() for n, b in model.module.named_buffers() if "running" in n}
    return backend.all_gather_object(model.sharded_state_dict()), mine


def test_buffers_that_differ_between_ranks_are_saved_as_rank0s_and_resume_exactly(tmp_path: Path) -> None:
    # BatchNorm's running statistics: each rank's from its own batch until the next forward broadcasts
    # rank 0's; slices of each rank's copy stitched a buffer no rank held
    for strategy, world in (("ddp", 2), ("zero3", 2), ("fsdp", 2), ("ddp-pp2", 4)):
        out = run_world(world, _saved_and_rank0_buffers, strategy)
        saved = full_tensors_from_shards(out[0][0])
        holders = [r for r in out if r[1]]  # under a pipeline: the dp rank 0 of each stage
        for name in {n for r in holders for n in r[1]}:
            rank0 = next(r[1][name] for r in holders if name in r[1])
            assert torch.equal(saved[name], rank0), (strategy, name)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    ck, again = tmp_path / "bn", tmp_path / "bn-again"
    cfg = ["backend.world_size=2", "data.global_batch_size=8", "train.steps=4", "optimizer.warmup_steps=0"]
    run = {"model": _bn_net, "train_data": data, "eval_data": data, "loss_fn": "mse"}
    whole = run_training(_cfg(tmp_path, *cfg, f"checkpoint.dir={ck}", "checkpoint.every=2"), **run)
    step2 = f"checkpoint.resume={ck / 'step_00000002'}"
    resumed = run_training(_cfg(tmp_path, *cfg, f"checkpoint.dir={again}", step2), **run)
    assert resumed[0].losses == whole[0].losses[2:]
    a, b = _params(ck / "step_00000004"), _params(again / "step_00000004")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _steps(backend: CommunicationBackend, config: TrainConfig, task: Any, upto: int) -> list[Any]:
    """Steps to ``upto`` (committing as due): each (step, applied, loss, loss scale)."""
    trainer = Trainer(config, backend, task=task)
    out = []
    while trainer.step < upto:
        applied, loss, _ = trainer.train_step()
        trainer.step += 1
        out.append((trainer.step, applied, loss, trainer.scaler.scale if trainer.scaler else None))
        end_step(trainer)
    return out


def test_an_elastic_restore_at_the_committed_size_goes_on_with_its_dropout_and_loss_scale(
    tmp_path: Path,
) -> None:
    # a restart at the same world size (torchrun restarting every worker) from elastic.dir: each rank's
    # RNG states and the fp16 loss scale (backed off by the overflows before the commit) come back
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    net = lambda: torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))  # noqa: E731
    task = task_from_objects(load_config(overrides=[]), net, data, data, "mse")
    sets = ["backend.world_size=2", "data.global_batch_size=8", "train.precision=fp16", "train.steps=6"]
    sets += ["optimizer.warmup_steps=0", "train.max_nonfinite_steps=6"]
    plain = _cfg(tmp_path, *sets)
    whole = run_world(2, _steps, plain, task, 6)[0]
    assert whole[2][3] < 2.0**16 and all(applied for _, applied, _, _ in whole[2:])  # backed off, then trains
    elastic = _cfg(tmp_path, *sets, "elastic.commit_every=3", f"elastic.dir={tmp_path / 'node'}")
    run_world(2, _steps, elastic, task, 3)  # stopped after the commit of step 3
    again = run_world(2, _steps, elastic, task, 6)[0]  # new ranks of the same size restore it
    assert again == whole[3:]
