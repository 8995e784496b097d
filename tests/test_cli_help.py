"""Settings a user can discover: ``dtlab train --help`` lists every setting with its default and a
description (from the config models), ``dtlab config --describe`` adds the allowed values, ``--set KEY
VALUE`` works like ``KEY=VALUE``; the run header names the plan and the summary gives each quantity
as the step lines do."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel

from dtlab.cli import main
from dtlab.config import TrainConfig
from dtlab.config_doc import settings
from dtlab.testing import TINY_LM


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_train_help_lists_every_setting_with_default_and_description(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    listed = {s.name: s for s in settings()}
    assert sorted(listed) == sorted(_leaves(TrainConfig))  # every field of every section, nothing else
    for s in listed.values():
        assert s.description, f"{s.name} has no #: comment in dtlab/config_sections/"
        assert re.search(rf"^    {re.escape(s.name)}=\S", out, re.M), s.name
    assert "    train.steps=300" in out and "optimizer steps to train" in out
    assert "logging.run_dir=runs/{time}" in out and "dtlab config --describe" in out
    assert "--set train.steps 50" in " ".join(out.split())  # both spellings of --set explained


def test_config_describe_and_set_key_value(capsys: Any) -> None:
    assert main(["config", "--describe", "--set", "train.steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "  train.steps = 40 (default 300)\n      allowed: int >= 1\n" in out
    assert 'allowed: "fp32" | "bf16" | "fp16"' in out
    assert 'allowed: "ddp" | "zero1" | "zero2" | "zero3" | "fsdp"' in out  # from the pairing table
    assert "allowed: float > 0, <= 1" in out  # optimizer.gamma's bounds
    assert main(["config", "--set", "train.steps", "40", "--set", "strategy.model=fsdp"]) == 0
    out = capsys.readouterr().out
    assert "steps: 40" in out and "model: fsdp" in out
    with pytest.raises(SystemExit) as info:
        main(["config", "--set", "train.steps", "40", "50"])
    assert info.value.code == 2
    assert "--set train.steps 40 50: give one setting per --set" in capsys.readouterr().err


def test_header_names_the_plan_and_the_summary_agrees_with_the_step_lines(capsys: Any) -> None:
    sets = [*TINY_LM, "backend.name=inmemory", "backend.world_size=2", "train.steps=4", "train.eval_every=2"]
    sets += ["data.accumulation_steps=2", "logging.log_every=2", "logging.run_dir=null"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err
    head = next(line for line in text.splitlines() if line.startswith("dtlab train: ") and "|" in line)
    for part in ("ddp/ddp on mesh dp2", "precision fp32", "accumulation 2 x micro-batch 2"):
        assert part in head, head
    assert "compression none" in head and "elastic off" in head
    step_sent = re.findall(r"sent ([\d.]+) MB/rank", text)[-1]
    assert re.search(rf"sent MB/rank \(largest rank\)\s+{re.escape(step_sent)} *\n", text), text
    assert re.search(r"eval loss \(last\)\s+\d+\.\d{4} *\n", text)  # as the training loss: 4 decimals
    share = re.search(r"comm share of step time\s+([\d.]+)%", text)
    assert share is not None  # a percentage, as in the profile table
    assert re.search(r"tok/s", text) and re.search(r"tokens/s\s+[\d,]+ *\n", text)  # a language model


def test_the_header_of_a_pipeline_names_its_micro_batches(capsys: Any) -> None:
    sets = [*TINY_LM, "model.n_layers=2", "backend.name=inmemory", "backend.world_size=2", "parallel.pp=2"]
    sets += ["parallel.micro_batches=4", "train.steps=1", "train.eval_every=0", "logging.run_dir=null"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    text = capsys.readouterr().err
    head = next(line for line in text.splitlines() if line.startswith("dtlab train: ") and "|" in line)
    # the dp rank's 8 samples run as 4 pipeline micro-batches of 2, not one micro-batch of 8
    assert "| pipeline 1f1b: 4 micro-batches x 2 |" in head and "accumulation" not in head, head


def test_a_task_without_tokens_reports_samples_per_second_only(capsys: Any) -> None:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from dtlab.config import load_config
    from dtlab.trainers import run_training

    x = torch.linspace(-1, 1, 64).reshape(32, 2)
    sets = ["backend.name=inmemory", "backend.world_size=2", "train.steps=2", "data.global_batch_size=8"]
    sets += ["train.eval_every=0"]
    config = load_config(overrides=sets)
    config = config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": None})})
    results = run_training(
        config, model=nn.Linear(2, 1), train_data=TensorDataset(x, x[:, :1]), loss_fn="mse"
    )
    summary = results[0].summary
    assert summary["samples/s"] > 0 and summary["tokens/s"] is None  # not samples/s again as tokens/s
    head = next(
        line for line in capsys.readouterr().err.splitlines() if line.startswith("dtlab train: custom (")
    )
    assert "| built whole: peak >= 12 B host per rank (the whole model) |" in head, head  # not 0.0 MiB


def test_the_dense_warm_up_is_in_the_header_and_the_step_lines(capsys: Any) -> None:
    sets = [*TINY_LM, "backend.name=inmemory", "backend.world_size=2", "train.steps=3", "logging.log_every=1"]
    sets += ["logging.run_dir=null", "compression.algorithm=oktopk", "compression.density=0.05"]
    sets += ["compression.dense_warmup_steps=2"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err
    head = next(line for line in text.splitlines() if line.startswith("dtlab train: ") and "|" in line)
    assert "compression oktopk @ 0.05 after 2 dense steps" in head, head
    steps = [line for line in text.splitlines() if re.match(r"step +\d+ \|", line)]
    assert [("dense warm-up (2 steps)" in line) for line in steps] == [True, True, False], steps


def test_a_reader_that_stops_early_ends_the_output_quietly() -> None:
    import subprocess
    import sys

    # `dtlab config --describe | head`: the reader is gone before dtlab writes (closed at once here)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab", "config", "--describe"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipeError" not in err, err


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["train", "--steps", "10"], "--set train.steps=10"),
        (["train", "--lr=0.1"], "--set optimizer.lr=0.1"),
        (["train", "train.steps=10"], "--set train.steps=10"),  # --set left out
        (["config", "--world-size", "2"], "--set backend.world_size=2"),
        (["train", "--strategy", "fsdp"], "--set strategy.FIELD=fsdp (FIELD one of model, optimizer"),
        (["train", "--no-such-thing"], "--set KEY=VALUE (every KEY: dtlab train --help)"),
        (["train", "--optimizer.lrr", "1"], "--set optimizer.lr=1"),  # not strategy.optimizer=1
    ],
)
def test_an_argument_that_is_a_setting_names_its_set_form(args: list[str], hint: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtlab {args[0]}: error: unrecognized arguments: {' '.join(args[1:])}; "), err
    assert hint in err, err
