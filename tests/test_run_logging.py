"""What a run leaves to look at: a fresh run directory per run (``latest`` beside it, a resume
continuing its own), TensorBoard event files read back by TensorBoard's own reader, a CSV file,
``loss.png`` and ``dtlab plot`` overlaying runs."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dtlab.cli import main
from dtlab.config import load_config
from dtlab.errors import CheckpointError, ConfigError, RankFailedError
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training
from dtlab.trainers.rundir import choose_run_dir

BASE = [
    "backend.name=inmemory",
    "backend.world_size=2",
    *TINY_LM,
    "train.steps=6",
    "train.eval_every=3",
    "logging.log_every=2",
    "logging.progress=false",
]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_runs_get_fresh_directories_and_a_resume_continues_its_own(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    sets = [*BASE, f"logging.run_dir={runs}/{{time}}", f"checkpoint.dir={tmp_path / 'ck'}"]
    first = run_training(load_config(overrides=sets))[0]
    second = run_training(load_config(overrides=sets))[0]  # the same second, likely: a -2 suffix then
    assert first.run_dir and second.run_dir and first.run_dir != second.run_dir
    dirs = sorted(p for p in runs.iterdir() if p.name != "latest")
    assert [d.name for d in dirs] == sorted([Path(first.run_dir).name, Path(second.run_dir).name])
    for d in dirs:  # two runs, two metrics files, each with its own 3 training records
        assert [r["step"] for r in _records(d) if "loss" in r] == [2, 4, 6]
        assert (d / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (d / "profile.json").is_file()
    assert (runs / "latest").resolve() == Path(second.run_dir).resolve()
    # a resume (the checkpoint of the second run, step 6) continues the second run's directory
    resumed = run_training(load_config(overrides=[*sets, "train.steps=8", "checkpoint.resume=true"]))[0]
    assert resumed.start_step == 6 and Path(resumed.run_dir or "") == Path(second.run_dir)
    assert [r["step"] for r in _records(Path(second.run_dir)) if "loss" in r] == [2, 4, 6, 8]
    assert len([p for p in runs.iterdir() if p.name != "latest"]) == 2
    # a directory named outright: a second fresh run beside it, never over it
    named = tmp_path / "exp"
    a = run_training(load_config(overrides=[*BASE, f"logging.run_dir={named}"]))[0]
    b = run_training(load_config(overrides=[*BASE, f"logging.run_dir={named}"]))[0]
    assert (a.run_dir, b.run_dir) == (str(named), str(tmp_path / "exp-2"))
    assert choose_run_dir(str(named), False, None) == tmp_path / "exp-3"
    assert choose_run_dir(str(named), True, None) == named  # a resume appends where it is told


def test_tensorboard_csv_and_plot_show_the_same_loss(tmp_path: Path, capsys: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    sets = [*BASE, f"logging.run_dir={run}", "logging.tensorboard=true", "logging.csv=true"]
    result = run_training(load_config(overrides=sets))[0]
    logged = {r["step"]: r for r in _records(run) if "loss" in r}
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "throughput/tokens_per_s", "eval/loss"}
    assert expected | {"comm/bytes_sent_MB", "memory/rank0_MB"} <= tags, tags
    tb_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged.keys() == {2, 4, 6} and tb_loss.keys() == {1, 2, 3, 4, 5, 6}  # every step's loss
    every = {s: v for rec in logged.values() for s, v in rec["losses"]}
    assert every == dict(result.losses)
    for step, value in tb_loss.items():  # TensorBoard stores float32
        assert value == pytest.approx(every[step], rel=1e-6)
    tb_eval = {e.step: e.value for e in events.Scalars("eval/loss")}
    assert tb_eval == pytest.approx({s: v["eval_loss"] for s, v in result.evals})
    sent = {e.step: e.value for e in events.Scalars("comm/bytes_sent_MB")}
    assert sent[6] == pytest.approx(max(logged[6]["bytes_sent_per_rank"]) / 1e6, rel=1e-6)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert {int(r["step"]): float(r["loss"]) for r in rows if r["loss"]} == pytest.approx(
        {s: r["loss"] for s, r in logged.items()}, rel=1e-5
    )
    # dtlab plot: two runs overlaid in one PNG; a directory without metrics is one clear error
    other = tmp_path / "other"
    run_training(load_config(overrides=[*BASE, f"logging.run_dir={other}", "optimizer.lr=0.01"]))
    out = tmp_path / "both.png"
    assert main(["plot", str(run), str(other), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "2 runs: run, other" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_logging_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"only placeholder allowed is \{time\}"):
        load_config(overrides=["logging.run_dir=runs/{date}"])
    with pytest.raises(ConfigError, match=r"write into logging\.run_dir, which is null"):
        load_config(overrides=["logging.run_dir=null", "logging.csv=true"])


def test_a_resume_from_a_missing_directory_is_announced(tmp_path: Path) -> None:
    typo = tmp_path / "ckpt-typo"
    sets = [*BASE, "train.steps=1", "logging.run_dir=null", f"checkpoint.dir={typo}"]
    sets.append("checkpoint.resume=true")
    result = run_training(load_config(overrides=sets))[0]
    assert result.start_step == 0
    notes = " ".join(result.resume_notes)  # the run's own lock may have made the directory by then
    where = re.escape(repr(str(typo)))
    assert re.search(rf"no checkpoint in {where} \(it (does not exist|holds no step directory)\)", notes)
    assert notes.endswith("): starting at step 0")
    refused = r"strict_resume=true refuses to start at step 0"
    with pytest.raises((CheckpointError, RankFailedError), match=refused) as info:
        strict = [*sets, f"checkpoint.dir={tmp_path / 'other'}", "checkpoint.strict_resume=true"]
        run_training(load_config(overrides=strict))  # (the first run saved its step 1 in typo)
    assert f"no checkpoint in {str(tmp_path / 'other')!r}" in str(info.value)


def test_bytes_at_a_step_follow_the_logged_steps() -> None:
    from dtlab.trainers.plots import Curves

    c = Curves("r", sent_mb=[(20, 60.0), (40, 116.0), (60, 172.0)])
    assert c.mb_at(30) == pytest.approx(88.0) and c.mb_at(60) == 172.0
    assert c.mb_at(1) == pytest.approx(60.0 - 2.8 * 19)  # before the first record: the same rate back
    assert c.mb_at(61) is None and Curves("r", sent_mb=[(20, 1.0), (40, 100.0)]).mb_at(0) == 0.0
