"""A plain loss or decoding step on logits the tensor plan leaves split over tp (the head ``"colwise"``,
as dtlab's transformer plans it): each rank's output holds ``V/tp`` of the classes. ``F.cross_entropy``
on it trained with no error when the targets fell below ``V/tp`` (1.24 relative error against one process
after 3 SGD steps at tp=2, a loss that differed between the tp ranks: 2.764 and 2.779 against one
process's 3.456) and stopped with torch's "Target out of bounds" otherwise. Now the output is marked
(``SplitLogits``) and such a reduction over its classes is refused on every tp rank, naming
``model.cross_entropy``, which still equals one process; element-wise use and ``train_step`` with
``model.cross_entropy`` are unchanged, and a pipeline's inference output is marked on every pp rank.
``max``/``sort``/``mean`` over the classes ran too (``out.pow(2).mean().backward()`` gave every
replicated parameter twice torch's gradient at tp=2): refused now over the class dim or the whole
tensor, still allowed over another dim and after a ``sum`` over the classes."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.core.rng import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel, TensorParallelModel, transformer_plan
from dtlab.models.tensor import vocab_parallel_argmax
from dtlab.models.tensor._split_logits import SplitLogits
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world
from dtlab.zoo import TransformerLM

VOCAB, LR = 32, 0.5


def _build() -> TransformerLM:
    with seeded_init(0):
        return TransformerLM(d_model=16, n_layers=2, n_heads=2, seq_len=8, vocab=VOCAB)


def _tokens() -> torch.Tensor:
    """Token ids below VOCAB / 2: a plain cross entropy on one rank's half of the classes would run."""
    return torch.randint(0, VOCAB // 2, (4, 9), generator=torch.Generator().manual_seed(0))


def _refusal(call: Any) -> str:
    try:
        call()
    except StrategyError as exc:
        return str(exc)
    return "ran"


def _tensor_parallel(backend: CommunicationBackend) -> dict[str, Any]:
    model = TensorParallelModel(_build(), Mesh(backend, {"tp": 2}), plan=transformer_plan())
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    tokens = _tokens()
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = model(x)
    flat = out.reshape(-1, out.shape[-1])
    said = {
        "cross_entropy": _refusal(lambda: F.cross_entropy(flat, y.reshape(-1))),
        "log_softmax": _refusal(lambda: F.log_softmax(out, dim=-1)),
        "softmax": _refusal(lambda: out.float().softmax(-1)),
        "argmax": _refusal(lambda: out[:, -1].argmax(-1)),
        "element_wise": _refusal(lambda: (out * 2 + 1).sum()),
        "max": _refusal(lambda: out.max(-1).indices),
        "torch_max": _refusal(lambda: torch.max(out, dim=2)),
        "sort": _refusal(lambda: out.sort(descending=True)),
        "mean": _refusal(lambda: out.float().pow(2).mean()),
        "mean_classes": _refusal(lambda: out.mean(dim=(0, -1))),
        "special_log_softmax": _refusal(lambda: torch.special.log_softmax(out, -1)),
        "max_over_batch": _refusal(lambda: out.max(0).values.sum() + out.mean(1).sum()),
        "element_max": _refusal(lambda: torch.max(out, torch.zeros_like(out)).sum()),
        "summed_then_mean": _refusal(lambda: out.sum(-1).mean(-1).argmax()),
        "train_step": _refusal(lambda: model.train_step((x, y), F.cross_entropy)),
    }
    buf = io.BytesIO()
    torch.save(out.detach(), buf)  # saved and copied as the plain values (torch.load's weights_only too)
    buf.seek(0)
    said["saved"] = type(torch.load(buf, weights_only=True)).__name__
    said["copied"] = type(copy.deepcopy(out.detach())).__name__
    loss = model.cross_entropy(out, y)  # the vocabulary-parallel loss takes the marked output
    loss.backward()
    opt.step()
    return {"said": said, "loss": loss.item(), "state": model.full_state_dict()}


def test_a_plain_loss_on_split_logits_is_refused_and_model_cross_entropy_equals_one_process() -> None:
    net = _build()
    tokens = _tokens()
    want = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    want.backward()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    for got in run_world(2, _tensor_parallel, timeout=60):
        said = got["said"]
        refused = ("cross_entropy", "log_softmax", "softmax", "argmax", "max", "torch_max", "sort", "mean")
        for name in (*refused, "mean_classes", "special_log_softmax"):
            assert "leaves the head split over tp" in said[name], name
            assert "model.cross_entropy(logits, targets)" in said[name], name
        for name in ("element_wise", "max_over_batch", "element_max", "summed_then_mean"):
            assert said[name] == "ran", (name, said[name])  # not over the classes, or after their sum
        assert said["saved"] == said["copied"] == "Tensor"
        assert "loss_fn cross_entropy on the logits split over tp" in said["train_step"]
        assert got["loss"] == pytest.approx(want.item(), rel=1e-5)
        for k, v in net.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def _pipelined(backend: CommunicationBackend) -> str:
    """pp2 x tp2: inference through the stages; the output reaches every pp rank marked alike."""
    model = HybridShardedModel(
        _build(), Mesh(backend, {"pp": 2, "tp": 2}), "ddp", tensor_plan=transformer_plan(), micro_batches=2
    )
    model.eval()
    with torch.no_grad():
        out = model(_tokens()[:, :-1])
    return _refusal(lambda: out.argmax(-1))


def test_a_pipelines_split_output_is_marked_on_every_rank() -> None:
    for said in run_world(4, _pipelined, timeout=60):
        assert "argmax on the model's output: the tensor plan leaves the head split over tp" in said


def _argmax_world(backend: CommunicationBackend) -> torch.Tensor:
    whole = torch.randint(0, 3, (5, 7, 8), generator=torch.Generator().manual_seed(4)).float()  # ties
    mine = whole.chunk(2, dim=-1)[backend.rank]
    return vocab_parallel_argmax(mine.as_subclass(SplitLogits), backend)


def test_vocab_parallel_argmax_is_the_whole_logits_argmax_ties_included() -> None:
    whole = torch.randint(0, 3, (5, 7, 8), generator=torch.Generator().manual_seed(4)).float()
    for got in run_world(2, _argmax_world, timeout=30):
        assert torch.equal(got, whole.argmax(-1))


USER_LM = """
import torch
from dtlab.data import TensorDataset
from dtlab.zoo import TransformerLM

def model():
    return TransformerLM(d_model=16, n_layers=1, n_heads=2, seq_len=8, vocab=32)

def copy():  # each token its own target: learnt in a few steps
    t = torch.randint(0, 32, (128, 8), generator=torch.Generator().manual_seed(0))
    return TensorDataset(t, t.clone())
"""


def test_the_trainers_accuracy_on_split_logits_is_the_whole_vocabularys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of your own whose head the plan leaves split, its targets labels: the Trainer's eval
    accuracy took each rank's argmax over its half of the classes (341.7% against 800.0% at tp=1, when
    it counted per sample); now the argmax of the whole vocabulary."""
    (tmp_path / "dtlab_split_lm.py").write_text(USER_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    accuracy = {}
    for tp in (1, 2):
        run = tmp_path / f"tp{tp}"
        sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false"]
        sets += [f"logging.run_dir={run}", "data.global_batch_size=16", "train.steps=30"]
        sets += ["train.eval_every=30", "optimizer.lr=0.01", "optimizer.warmup_steps=0"]
        sets += ["model.factory=dtlab_split_lm:model", "data.factory=dtlab_split_lm:copy"]
        sets += [f"parallel.tp={tp}"]
        assert main(["train", *(a for s in sets for a in ("--set", s))]) == 0
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        accuracy[tp] = [r["eval_accuracy"] for r in records if "eval_accuracy" in r][-1]
    assert accuracy[1] > 0.5 and accuracy[2] == pytest.approx(accuracy[1]), accuracy  # the copy task learnt


def _one_tp_rank(backend: CommunicationBackend) -> dict[str, Any]:
    """tp = 1 with a plan (a script written for any tp size): the head is whole, nothing to refuse."""
    model = HybridShardedModel(_build(), Mesh(backend, {"pp": 2}), "ddp", tensor_plan="auto", micro_batches=2)
    tokens = _tokens()
    with torch.no_grad():
        out = model(tokens[:, :-1])
    with seeded_init(0):
        head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, VOCAB))
    classes = HybridShardedModel(
        head,
        Mesh(backend, {"pp": 2}),
        "ddp",
        tensor_plan={"2": "colwise"},
        micro_batches=2,
        split_points=["1"],
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return {
        "marked": isinstance(out, SplitLogits),
        "loss": F.cross_entropy(out.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item(),
        "argmax": out.argmax(-1),
        "step": classes.train_step((x, tokens[:, 0].contiguous()), F.cross_entropy).item(),
    }


def test_at_one_tp_rank_the_output_is_whole_and_a_plain_loss_runs() -> None:
    """At tp = 1 the plan's 'colwise' head holds every class: F.cross_entropy, argmax on a pipeline's
    output and train_step(..., F.cross_entropy) run and equal one process (they were refused)."""
    net, tokens = _build(), _tokens()
    with torch.no_grad():
        logits = net(tokens[:, :-1])
    with seeded_init(0):
        head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, VOCAB))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want_step = F.cross_entropy(head(x), tokens[:, 0]).item()
    for got in run_world(2, _one_tp_rank, timeout=60):
        assert not got["marked"]
        assert got["loss"] == pytest.approx(
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
        )
        assert torch.equal(got["argmax"], logits.argmax(-1))
        assert got["step"] == pytest.approx(want_step, rel=1e-6)
