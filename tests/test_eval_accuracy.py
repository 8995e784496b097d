"""The Trainer's evaluation accuracy where the targets are sequences of labels (a token model of your
own, labels -100 left out): it divided the correct labels by the samples, not by the labels counted,
so a model right on 5 of 7 counted labels reported 250% (a run that learnt the copy task: 800%). Now
correct labels over counted labels: 5/7, on 2 in-memory ranks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dtlab.cli import main

USER = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from dtlab.data import TensorDataset

    class Echo(nn.Module):
        '''Predicts each input token (logits: a scaled one-hot of it).'''

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return F.one_hot(x, 8).float() * self.scale * 10

    def model():
        return Echo()

    def data():
        x = torch.randint(0, 8, (32, 4), generator=torch.Generator().manual_seed(0))
        y = x.clone()
        y[:, 3] = (x[:, 3] + 1) % 8  # one wrong label per row
        y[::2, 0] = -100  # every other row: one label left out
        dataset = TensorDataset(x, y)
        return dataset, dataset  # (training, held-out)
    """
)


def test_accuracy_over_sequences_of_labels_counts_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dtlab_echo_task.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false"]
    sets += [f"logging.run_dir={tmp_path / 'run'}", "data.global_batch_size=8", "train.steps=2"]
    sets += ["train.eval_every=2", "train.eval_batches=4", "optimizer.lr=0.001", "optimizer.warmup_steps=0"]
    sets += ["model.factory=dtlab_echo_task:model", "data.factory=dtlab_echo_task:data"]
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert accuracy and accuracy[-1] == pytest.approx(5 / 7), accuracy
