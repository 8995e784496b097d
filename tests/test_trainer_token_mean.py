"""The Trainer's default loss with targets -100 spread unevenly over ranks, micro-batches and pipeline
chunks: the mean over the global batch's counted targets, as one process on the same global batch (the
logged losses, the held-out loss, the parameters after the run) under DDP, ZeRO-1/2/3, FSDP, the dense
compressed reducer, accumulation, a pipeline, tensor parallelism (the vocabulary-split head) and hybrids,
and a SummedLoss of your own; an all -100 micro-batch, shard and pipeline chunk finite; a global batch of
only -100 trains as loss 0 with zero gradients; the count's one all-reduce, none on a tensor dataset
without -100. Plain SGD (a wrong scale shows). In-memory ranks, a tiny transformer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.config import load_config
from dtlab.core import seeded_init
from dtlab.data import TensorDataset
from dtlab.models.tensor import whole_cross_entropy
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import SummedLoss, Task, Trainer
from dtlab.trainers.tasks import builtin_model, cross_entropy_loss

T = 8  # tokens per sample
# counted targets per row, 8 rows a step (rank r of 2 takes rows r, r + 2, ...; with 2 accumulation
# steps its first micro-batch the first two of them)
KEEP = [
    *(8, 2, 5, 0, 8, 1, 3, 8),  # step 1: every rank, micro-batch and chunk its own count
    *(7, 2, 8, 3, 0, 0, 0, 0),  # step 2: each rank's second micro-batch, a pipeline's second chunk: all -100
    *(0, 6, 0, 8, 0, 1, 0, 4),  # step 3: rank 0's whole shard at dp 2 all -100
    *(0, 0, 0, 0, 0, 0, 0, 0),  # step 4: the whole global batch -100
]
EVAL_KEEP = (8, 1, 0, 5, 2, 8, 0, 3, 1, 1, 8, 6, 0, 2, 7, 4)
BASE = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=2",
    f"model.seq_len={T}",
    "data.shuffle=false",
    "optimizer.name=sgd",
    "optimizer.lr=0.5",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
    "optimizer.clip_grad_norm=null",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    f"train.steps={len(KEEP) // 8}",
    f"train.eval_every={len(KEEP) // 8}",
    "train.eval_batches=2",
    "strategy.persistence_threshold=0",
    "logging.progress=false",
    "logging.run_dir=null",
]


def _tokens(keep: tuple[int, ...] | list[int], seed: int) -> TensorDataset:
    """Random tokens, each row's targets -100 after its first ``keep[row]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (len(keep), T), generator=gen)
    y = torch.randint(0, 256, (len(keep), T), generator=gen)
    y[torch.arange(T) >= torch.tensor(keep).unsqueeze(1)] = -100
    return TensorDataset(x, y)


def _next_token_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss of your own: Hugging Face's shift (position t scored against target t + 1), summed."""
    return F.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="sum")


SHIFTED = SummedLoss(_next_token_sum, count=lambda y: (y[:, 1:] != -100).sum())


def _train(backend: CommunicationBackend, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Each run on this world: its logged losses, held-out loss and whole parameters at the end (a run
    named "summed ..." with the SummedLoss above)."""
    out = {}
    for name, overrides in runs.items():
        config = load_config(overrides=[*BASE, f"backend.world_size={backend.world_size}", *overrides])
        task = Task(builtin_model(config)[0], _tokens(KEEP, 1), _tokens(EVAL_KEEP, 2))
        if name.startswith("summed"):
            task = Task(task.build_model, task.train_data, task.eval_data, loss_fn=SHIFTED)
        trainer = Trainer(config, backend, task=task)
        result = trainer.fit()
        state = trainer.model.full_state_dict()
        trainer.close()
        out[name] = (result.losses, result.evals[-1][1]["eval_loss"], state)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(got: list[dict[str, Any]], one: dict[str, Any]) -> None:
    """Every rank's runs against one process: the same steps, losses, held-out loss and parameters."""
    for ranks in got:
        for name, (losses, eval_loss, state) in ranks.items():
            want_losses, want_eval, want_state = one["summed" if name.startswith("summed") else "one"]
            assert [s for s, _ in losses] == [s for s, _ in want_losses], name
            for (_, a), (_, b) in zip(losses, want_losses, strict=True):
                assert abs(a - b) <= 1e-6 * abs(b), (name, losses, want_losses)
            assert abs(eval_loss - want_eval) <= 1e-6 * want_eval, (name, eval_loss, want_eval)
            assert state.keys() == want_state.keys(), name
            worst = max(_rel(state[k], v) for k, v in want_state.items())
            assert worst <= 1e-6, (name, worst)


def test_the_default_loss_is_the_global_batch_token_mean_under_every_layout() -> None:
    """Also a SummedLoss of your own (a shifted next-token loss) under DDP with accumulation and a
    pipeline."""
    (one,) = run_world(1, _train, {"one": [], "summed": []}, timeout=120)
    steps = len(KEEP) // 8
    config = load_config(overrides=[*BASE, "backend.world_size=1"])
    with seeded_init(config.train.seed):  # the initial model, as the Trainer builds it
        net = builtin_model(config)[0]()
    x, y = _tokens(KEEP, 1)[torch.arange(8)]  # the first global batch
    with torch.no_grad():
        out = net(x)
        first = {
            "one": F.cross_entropy(out.flatten(0, 1), y.flatten()),
            "summed": _next_token_sum(out, y) / (y[:, 1:] != -100).sum(),
        }
    for name in ("one", "summed"):
        losses = one[name][0]
        assert [s for s, _ in losses] == list(range(1, steps + 1)), name  # every step applied, none NaN
        assert abs(losses[0][1] - float(first[name])) <= 1e-6 * float(first[name]), name
        assert losses[-1][1] == 0.0  # the global batch of only -100: loss 0
    two = {
        "ddp accumulation": ["strategy.model=ddp", "data.accumulation_steps=2"],
        "zero3 accumulation": ["strategy.model=zero3", "data.accumulation_steps=2"],
        "fsdp": ["strategy.model=fsdp"],
        "zero1 accumulation": ["strategy.model=zero1", "data.accumulation_steps=2"],
        "zero2": ["strategy.model=zero2"],
        "dense compression accumulation": [
            "compression.algorithm=dense",
            "compression.dense_warmup_steps=0",
            "data.accumulation_steps=2",
        ],
        "pipeline": ["parallel.pp=2", "parallel.micro_batches=2"],
        "tp accumulation": ["parallel.tp=2", "data.accumulation_steps=2"],
        "summed ddp accumulation": ["strategy.model=ddp", "data.accumulation_steps=2"],
        "summed pipeline": ["parallel.pp=2", "parallel.micro_batches=2"],
    }
    four = {
        "dp x tp, fsdp": ["parallel.tp=2", "strategy.model=fsdp", "data.accumulation_steps=2"],
        "dp x pp": ["parallel.pp=2", "parallel.micro_batches=2"],
    }
    _check([*run_world(2, _train, two, timeout=240), *run_world(4, _train, four, timeout=240)], one)


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset that is not a tensor dataset: its targets cannot be checked before the run."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i]


def _all_reduces_per_step(backend: CommunicationBackend) -> dict[str, int]:
    out = {}
    for name in ("tensor dataset", "other dataset"):
        config = load_config(overrides=[*BASE, "backend.world_size=2", "train.eval_every=0"])
        train = _tokens([T] * 16, 3)  # no target -100
        task = Task(builtin_model(config)[0], train if name == "tensor dataset" else _Rows(train), train)
        trainer = Trainer(config, backend, task=task)
        before = backend.stats["all_reduce"].calls
        trainer.train_step()
        out[name] = backend.stats["all_reduce"].calls - before
    return out


def test_the_count_costs_one_all_reduce_and_none_on_a_tensor_dataset_without_ignored_targets() -> None:
    for counts in run_world(2, _all_reduces_per_step):
        assert counts["other dataset"] == counts["tensor dataset"] + 1, counts


def test_the_default_cross_entropy_is_torchs_mean_and_zero_where_every_target_is_ignored() -> None:
    """dtlab.trainers' cross entropy and a tp model's gathered-logits model.cross_entropy: bitwise
    F.cross_entropy's mean and its gradient; where every target is -100, 0 with zero gradients
    (F.cross_entropy gives NaN)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, T, 11, generator=gen, requires_grad=True)
    y = torch.randint(0, 11, (3, T), generator=gen)
    y[1, 2:] = -100
    for fn in (cross_entropy_loss, whole_cross_entropy):
        want = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        got = fn(logits, y)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0])
        none = fn(logits, torch.full_like(y, -100))
        assert none.item() == 0.0
        assert torch.count_nonzero(torch.autograd.grad(none, logits)[0]) == 0
