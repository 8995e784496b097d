"""Your own model, data and loss: config factories, Python objects, the checks before any rank starts,
and ``dtlab.data.DistributedSampler`` as a drop-in for torch's sampler."""

from __future__ import annotations

import itertools
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.config import load_config
from dtlab.core.rng import seeded_init
from dtlab.data import DistributedSampler
from dtlab.errors import ConfigError, DataError, RankFailedError
from dtlab.testing import run_world
from dtlab.trainers import Trainer, build_task, run_training
from dtlab.trainers.feed import DataFeed

BASE = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
BASE += ["data.global_batch_size=16", "train.eval_every=0", "optimizer.warmup_steps=0"]


class Blobs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points in 4-d labelled by the side of a plane: a map-style Dataset, not dtlab's TensorDataset."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x @ torch.tensor([1.0, -2.0, 0.5, 1.0]) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import IterableDataset
    from test_custom_model_data import Blobs

    def model():
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def data():
        return Blobs()

    def split():
        return Blobs(200), Blobs(40)

    def loss(out, target):
        return nn.functional.cross_entropy(out, target) + 0.0 * out.sum()

    def not_a_model():
        return [1, 2]

    def broken():
        raise RuntimeError("disk on fire")

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(4), torch.tensor(0)

    def stream():
        return Stream()

    def singles():
        return [torch.zeros(4)] * 8

    def vector_loss(out, target):
        return nn.functional.cross_entropy(out, target, reduction="none")
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "dtlab_user_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return "dtlab_user_mod"


def _sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def test_cli_trains_your_model_and_data(user_module: str, capsys: Any, tmp_path: Path) -> None:
    sets = [*BASE, f"model.factory={user_module}:model", f"data.factory={user_module}:data"]
    sets += [f"model.loss={user_module}:loss", "train.steps=30", "train.eval_every=30"]
    sets += ["optimizer.lr=0.05", f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["train", *_sets(*sets)]) == 0
    out = capsys.readouterr().out
    assert "eval accuracy" in out  # classification read off the targets
    assert re.search(rf"task +{re.escape(user_module)}:model\b", out), out  # the factory named whole
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_accuracy" in r]
    assert evals[-1]["eval_accuracy"] > 0.8, evals
    # a (train, eval) pair from the factory; the built-in loss by name
    sets = [*BASE, f"model.factory={user_module}:model", f"data.factory={user_module}:split", "train.steps=2"]
    task = build_task(load_config(overrides=[*sets, "model.loss=cross_entropy"]))
    assert (len(task.train_data), len(task.eval_data)) == (200, 40) and task.classification


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.factory=no_such_pkg.mod:fn"], r"model.factory='no_such_pkg.mod:fn': cannot import"),
        (["model.factory={m}:nothing"], r"has no 'nothing'"),
        (
            ["model.factory={m}:not_a_model", "data.factory={m}:data"],
            r"returned an object of type list, not a torch.nn",
        ),
        (  # your model without data.factory meets the built-in corpus: the message says so
            ["model.factory={m}:model"],
            r"does not take the data's inputs \(shape \(3, 64\) int64\).*; without data.factory the data "
            r"is the built-in data.dataset='stdlib' \(byte windows .*set data.factory=",
        ),
        (["model.factory={m}:broken"], r"failed when called with no arguments: RuntimeError: disk on fire"),
        (["data.factory={m}:stream"], r"is a Stream: need a map-style torch Dataset"),
        (["data.factory={m}:singles"], r"\[0\] is a Tensor: each sample must be an \(input, target\) pair"),
        (
            ["model.factory={m}:model", "data.factory={m}:data", "model.loss=mse"],
            r"model.loss='mse' does not fit",
        ),
        (
            ["model.factory={m}:model", "data.factory={m}:data", "model.loss={m}:vector_loss"],
            r"returned shape \(3,\) float32 .* must return one number",
        ),
        (
            ["model.name=digits_cnn", "data.factory={m}:data"],
            r"model.name='digits_cnn' does not take the data",
        ),
        (["model.factory=not a reference"], r"model.factory must look like package.module:function"),
    ],
)
def test_bad_factories_are_one_clear_error_before_any_rank_starts(
    user_module: str, sets: list[str], message: str, capsys: Any
) -> None:
    overrides = [*BASE, *(s.format(m=user_module) for s in sets)]
    assert main(["train", *_sets(*overrides)]) == 2  # a ConfigError, before any rank started
    err = capsys.readouterr().err
    assert err.startswith("dtlab train: error:") and "rank" not in err.split(":")[1], err
    with pytest.raises(ConfigError, match=message):
        build_task(load_config(overrides=overrides))


def _python_api(backend: CommunicationBackend) -> float:
    cfg = load_config(overrides=[*BASE, "train.steps=40", "optimizer.lr=0.3", "train.eval_every=40"])
    x = torch.linspace(-1, 1, 128)[:, None]
    data = torch.utils.data.TensorDataset(x, 3 * x - 1)  # torch's own TensorDataset
    with seeded_init(7):  # the same start on every rank and in every run, whatever ran before
        model = nn.Linear(1, 1)
    res = Trainer(cfg, backend, model=model, train_data=data, loss_fn="mse").fit()
    return res.evals[-1][1]["eval_loss"]


def test_python_api_takes_a_module_a_dataset_and_a_loss() -> None:
    losses = run_world(2, _python_api, timeout=120)
    assert losses[0] == losses[1] < 0.05, losses  # y = 3x - 1 fitted (it starts near 4)
    cfg = load_config(overrides=[*BASE, "train.steps=3"])
    res = run_training(cfg, model=nn.Sequential(nn.Linear(4, 2)), train_data=Blobs(), loss_fn="cross_entropy")
    assert len(res) == 2 and res[0].losses == res[1].losses and len(res[0].losses) == 3
    with pytest.raises(ConfigError, match="loss_fn does not fit"):
        run_training(cfg, model=nn.Linear(4, 2), train_data=Blobs(), loss_fn="mse")


class _Range(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_sampler_is_torchs_distributed_sampler() -> None:
    for n, p, shuffle, drop_last, epoch in itertools.product(
        (10, 13, 3), (1, 4), (True, False), (True, False), (0, 2)
    ):
        data = _Range(n)
        ours = DistributedSampler(data, p, p - 1, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs = torch.utils.data.DistributedSampler(
            data, p, p - 1, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert isinstance(ours, Sampler) and list(ours) == list(theirs) and len(ours) == len(theirs)
    s = DistributedSampler(_Range(13), 2, 1, seed=1)
    loader = DataLoader(_Range(13), batch_size=3, sampler=s)
    whole = [int(i) for b in loader for i in b]
    s.start_at(4)  # resume after 4 samples of the epoch over both ranks: this rank skips 2
    assert [int(i) for b in loader for i in b] == whole[2:]
    with pytest.raises(ValueError, match="multiple of num_replicas=2"):
        s.start_at(3)
    with pytest.raises(ValueError, match="pass num_replicas and rank"):
        DistributedSampler(_Range(4))


def test_feed_with_workers_gives_the_same_batches() -> None:
    data = Blobs(64)
    plain = DataFeed(data, 8, 2, 1, 2, seed=4)
    workers = DataFeed(data, 8, 2, 1, 2, seed=4, num_workers=1)
    for _ in range(10):  # two epochs
        for (xa, ya), (xb, yb) in zip(plain.next_micro_batches(), workers.next_micro_batches(), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    position = {
        "epoch": 1,
        "offset": 16,
        "seed": 4,
        "num_samples": 64,
        "shuffle": True,
        "ranks": 2,
        "micro_batch": 2,
    }
    assert plain.state_dict() == workers.state_dict() == position


class _SkipsAHead(nn.Module):
    """A task head the loss never reaches (a pooler, an auxiliary head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _unused_head(backend: CommunicationBackend, sets: list[str]) -> tuple[bool, str]:
    cfg = load_config(overrides=[*BASE, "train.steps=3", "optimizer.weight_decay=0.1", *sets])
    with seeded_init(3):
        module = _SkipsAHead()
    before = module.head.weight.detach().clone()
    try:
        Trainer(cfg, backend, model=module, train_data=Blobs(), loss_fn="cross_entropy").fit()
    except Exception as exc:
        return False, str(exc)
    return bool(torch.equal(module.head.weight.detach(), before)), ""


def test_a_head_no_rank_uses_is_refused_naming_the_setting_and_left_out_with_it() -> None:
    for model in ("ddp", "zero2"):
        refused = run_world(2, _unused_head, [f"strategy.model={model}"], timeout=60)
        assert all(not kept and "strategy.find_unused_parameters=true" in err for kept, err in refused), (
            refused
        )
        sets = [f"strategy.model={model}", "strategy.find_unused_parameters=true"]
        # left out of the step as torch's DDP does: weight decay does not move it
        assert run_world(2, _unused_head, sets, timeout=60) == [(True, "")] * 2, model


class _HeadOnFirstStep(nn.Module):
    """A wide auxiliary head the loss reaches in the first forward only (big enough to be compressed)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 256), nn.Linear(256, 2))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x) + self.head(x) if self.calls == 1 else self.body(x)


def _head_then_unused(backend: CommunicationBackend) -> tuple[bool, str]:
    sets = ["train.steps=3", "strategy.find_unused_parameters=true", "optimizer.name=sgd"]
    sets += ["compression.algorithm=topka", "compression.density=0.1", "compression.dense_warmup_steps=0"]
    cfg = load_config(overrides=[*BASE, *sets])
    with seeded_init(3):
        module = _HeadOnFirstStep()
    try:
        Trainer(cfg, backend, model=module, train_data=Blobs(), loss_fn="cross_entropy").fit()
    except Exception as exc:
        return False, str(exc)
    return True, ""


def test_a_head_unused_after_its_first_step_trains_under_compression() -> None:
    """Compression with find_unused_parameters: the Trainer zeroes gradients with set_to_none=False,
    so a head used in step 1 only keeps being stepped with its error-feedback residual in steps 2-3
    (rather than the step refusing to drop that residual)."""
    assert run_world(2, _head_then_unused, timeout=60) == [(True, "")] * 2


class _Stream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Any:
        yield torch.zeros(4), torch.tensor(0)


def test_a_loader_a_stream_or_a_tensor_pair_is_refused_naming_what_to_pass() -> None:
    cfg = load_config(overrides=[*BASE, "train.steps=1"])
    x, y = Blobs().x, Blobs().y
    for data, fix in [
        (DataLoader(Blobs(), batch_size=4), r"pass its dataset \(train_data=loader.dataset\)"),
        (_Stream(), r"give its samples as a map-style Dataset"),
        ((x, y), r"pass torch.utils.data.TensorDataset\(x, y\)"),
    ]:
        with pytest.raises(ConfigError, match=fix):
            run_training(cfg, model=nn.Linear(4, 2), train_data=data, loss_fn="cross_entropy")


class _FailsAt(Blobs):
    """Blobs with float targets whose sample ``bad`` raises, and whose ``__len__`` may promise more."""

    def __init__(self, bad: int, extra: int = 0) -> None:
        super().__init__()
        self.bad, self.extra = bad, extra

    def __len__(self) -> int:
        return len(self.x) + self.extra

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad:
            raise KeyError(i)
        return self.x[i], self.x[i].sum(0, keepdim=True)  # past len(self.x): IndexError


def test_a_model_factory_a_loss_or_a_dataset_failing_mid_run_is_named() -> None:
    # before: "<lambda>() missing 1 required positional argument", torch's "element 0 of tensors does not
    # require grad" at backward, and the dataset's raw KeyError / IndexError from inside the DataLoader
    cfg = load_config(overrides=[*BASE, "train.steps=12"])
    with pytest.raises(
        ConfigError, match=r"model is called with no arguments, but .*<lambda>\(width\) cannot be"
    ):
        run_training(cfg, model=lambda width: nn.Linear(4, width), train_data=Blobs())
    with pytest.raises(
        RankFailedError, match=r"loss_fn returned a loss that does not depend on the model's output"
    ):
        run_training(cfg, model=nn.Linear(4, 2), train_data=Blobs(), loss_fn=lambda o, t: o.sum().detach())
    with pytest.raises(ConfigError, match=r"train_data\[259\] raised IndexError: .* \(its len\(\) is 260\)"):
        run_training(cfg, model=nn.Linear(4, 1), train_data=_FailsAt(-1, extra=4), loss_fn="mse")
    with pytest.raises(RankFailedError) as info:
        run_training(cfg, model=nn.Linear(4, 1), train_data=_FailsAt(100), loss_fn="mse")
    cause = info.value.__cause__
    assert isinstance(cause, DataError), cause
    assert re.search(
        r"reading samples \[.*\b100\b.*\] of the training data \(244 samples\) raised KeyError",
        str(cause),
    )
