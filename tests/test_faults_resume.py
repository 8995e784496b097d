"""Faults injected into a checkpoint directory before ``checkpoint.resume=true``: each case is one fault
and what the resume must do (docs/checkpoints.md, "What dtlab promises when things fail")."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from dtlab.checkpoint import read_checkpoint
from dtlab.config import TrainConfig, load_config
from dtlab.errors import CheckpointError, ConfigError, RankFailedError
from dtlab.testing import TINY_LM
from dtlab.trainers import TrainResult, run_training

BASE = [
    "backend.name=inmemory",
    "backend.world_size=2",
    *TINY_LM,
    "optimizer.warmup_steps=2",
    "optimizer.schedule=constant",  # the lr does not depend on train.steps: 6 steps = 6 of 8 steps
    "train.eval_every=0",
    "logging.progress=false",
    "logging.run_dir=null",
    "checkpoint.every=2",
]


def _cfg(*extra: str) -> TrainConfig:
    return load_config(overrides=[*BASE, *extra])


def _train(ck: Path, steps: int, *extra: str) -> TrainResult:
    return run_training(_cfg(f"checkpoint.dir={ck}", f"train.steps={steps}", *extra))[0]


def _resume(ck: Path, steps: int, *extra: str) -> TrainResult:
    return _train(ck, steps, "checkpoint.resume=true", *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float]]:
    """The losses of 8 uninterrupted steps."""
    return _train(tmp_path_factory.mktemp("ref") / "ck", 8).losses


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A run of 6 steps that kept step_2, step_4 and step_6 (latest -> step_6)."""
    ck = tmp_path / "ck"
    _train(ck, 6, "checkpoint.keep_last=5")
    assert _steps(ck) == ["step_00000002", "step_00000004", "step_00000006"]
    return ck


def _steps(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))


def _corrupt(step: Path) -> bytes:
    """Flip the last byte of rank 1's model shard; returns the corrupted contents."""
    shard = step / "model_rank00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    return shard.read_bytes()


def _run_id(step: Path) -> str:
    return str(json.loads((step / "meta.json").read_text())["run"]["id"])


def _cause(info: pytest.ExceptionInfo[Any]) -> BaseException:
    exc = info.value
    return exc.__cause__ if isinstance(exc, RankFailedError) else exc


def test_latest_missing_takes_the_newest_step_and_says_so(
    saved: Path, reference: list[tuple[int, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    # killed between the rename of the first step directory and the first pointer write
    (saved / "latest").unlink()
    res = _resume(saved, 8, "checkpoint.keep_last=5")
    assert res.resumed_from == str(saved / "step_00000006") and res.start_step == 6
    assert any("no latest pointer" in n for n in res.resume_notes)
    assert f"dtlab: resumed from {saved / 'step_00000006'} (step 6)" in capsys.readouterr().err
    assert res.losses == reference[6:]  # bitwise the uninterrupted run's
    assert _steps(saved) == ["step_00000002", "step_00000004", "step_00000006", "step_00000008"]
    # strict mode accepts it too: the newest step directory verifies, nothing was passed over
    (saved / "latest").unlink()
    assert _resume(saved, 8, "checkpoint.strict_resume=true").resumed_from == str(saved / "step_00000008")


def test_corrupted_newest_step_falls_back_and_is_set_aside_not_overwritten(
    saved: Path, reference: list[tuple[int, float]], caplog: pytest.LogCaptureFixture
) -> None:
    before = _corrupt(saved / "step_00000006")
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _resume(saved, 8, "checkpoint.strict_resume=true")
    assert isinstance(_cause(info), CheckpointError)
    assert "model_rank00001.safetensors is corrupted" in str(_cause(info)) and "strict_resume" in str(
        _cause(info)
    )
    with caplog.at_level(logging.WARNING):
        res = _resume(saved, 8, "checkpoint.keep_last=5")
    assert res.resumed_from == str(saved / "step_00000004")
    assert any("step_00000006, which does not verify" in n and "is corrupted" in n for n in res.resume_notes)
    assert "fell back to step_00000004" in caplog.text
    assert res.losses == reference[4:]
    # the run saved step 6 again: the corrupted directory it did not write was renamed, not replaced
    kept = [p for p in saved.iterdir() if p.name.startswith("superseded-step_00000006-")]
    assert len(kept) == 1 and (kept[0] / "model_rank00001.safetensors").read_bytes() == before
    assert "was not written by this run: moved to superseded-step_00000006-" in caplog.text
    assert read_checkpoint(saved).step == 8


def test_newer_step_of_the_same_run_wins_over_a_stale_latest(
    saved: Path, reference: list[tuple[int, float]]
) -> None:
    # killed during the pointer write of step 6: a half-written temporary pointer, latest still old
    (saved / "latest").write_text("step_00000004\n")
    (saved / ".tmp-latest-0123abcd").write_text("step_000")
    res = _resume(saved, 8, "checkpoint.keep_last=5")
    assert res.resumed_from == str(saved / "step_00000006")
    assert any("the same run's save, interrupted before latest moved" in n for n in res.resume_notes)
    assert res.losses == reference[6:]
    # the leftover pointer is not this run's: kept (it could be another run's save) and named
    assert [p.name for p in saved.iterdir() if p.name.startswith(".tmp-")] == [".tmp-latest-0123abcd"]
    assert any("1 leftover(s) of interrupted saves" in n for n in res.resume_notes)


def test_newer_step_of_another_branch_is_not_taken_nor_overwritten(
    saved: Path, reference: list[tuple[int, float]]
) -> None:
    # a resume from step 2 (a branch): latest moves to the branch's step 4, step 6 is the old branch's
    first = _train(saved, 4, f"checkpoint.resume={saved / 'step_00000002'}", "checkpoint.keep_last=5")
    assert first.losses == reference[2:4]
    assert (saved / "latest").read_text().strip() == "step_00000004"
    assert [p.name for p in saved.iterdir() if p.name.startswith("superseded-step_00000004-")]
    old6 = json.loads((saved / "step_00000006" / "meta.json").read_text())["run"]["id"]
    res = _resume(saved, 6, "checkpoint.keep_last=1")
    assert res.resumed_from == str(saved / "step_00000004")
    assert any("step_00000006" in n and "another run's" in n for n in res.resume_notes)
    kept = [p for p in saved.iterdir() if p.name.startswith("superseded-step_00000006-")]
    assert len(kept) == 1 and json.loads((kept[0] / "meta.json").read_text())["run"]["id"] == old6
    # keep_last=1 pruned only this run's lineage (step 2 and the branch's step 4), nothing else
    assert _steps(saved) == ["step_00000006"]


def test_latest_outside_the_directory_is_refused(saved: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for bad in ("../elsewhere", str(elsewhere), "step_00000004/../../elsewhere", ""):
        (saved / "latest").write_text(bad + "\n")
        with pytest.raises(CheckpointError, match="refusing to follow it"):
            read_checkpoint(saved)
        with pytest.raises((CheckpointError, RankFailedError)) as info:
            _resume(saved, 6, "checkpoint.strict_resume=true")
        assert "refusing to follow it" in str(_cause(info))
        res = _resume(saved, 6)  # nothing to train: only the choice
        assert res.resumed_from == str(saved / "step_00000006"), bad
        assert any("refusing to follow it" in n for n in res.resume_notes)


def test_pointer_to_a_missing_step_and_nothing_that_verifies(saved: Path) -> None:
    (saved / "latest").write_text("step_00000010\n")
    res = _resume(saved, 6)
    assert res.resumed_from == str(saved / "step_00000006")
    assert any("names step_00000010, which does not exist" in n for n in res.resume_notes)
    for s in (2, 4, 6):
        _corrupt(saved / f"step_{s:08d}")
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _resume(saved, 8)
    msg = str(_cause(info))
    assert "no checkpoint in" in msg and msg.count("is corrupted") == 3 and "checkpoint.resume=false" in msg
    assert _steps(saved) == ["step_00000002", "step_00000004", "step_00000006"]  # nothing deleted


def test_fresh_run_keeps_every_step_it_did_not_write(saved: Path) -> None:
    ids = {p.name: json.loads((p / "meta.json").read_text())["run"]["id"] for p in saved.glob("step_*")}
    res = _train(saved, 4, "checkpoint.keep_last=1")  # resume=false: a fresh run in a used directory
    assert res.resumed_from is None and res.start_step == 0
    note = [n for n in res.resume_notes if "this run does not continue" in n]
    assert len(note) == 1 and "to continue from them instead, set checkpoint.resume=true" in note[0], note
    # the old run's step 2 and 4 were in the way of this run's saves: renamed, not replaced; this run's
    # own step 2 was pruned (keep_last=1); the old run's step 6 is untouched
    assert _steps(saved) == ["step_00000004", "step_00000006"]
    assert (
        json.loads((saved / "step_00000006" / "meta.json").read_text())["run"]["id"] == ids["step_00000006"]
    )
    for name in ("step_00000002", "step_00000004"):
        kept = [p for p in saved.iterdir() if p.name.startswith(f"superseded-{name}-")]
        assert len(kept) == 1 and json.loads((kept[0] / "meta.json").read_text())["run"]["id"] == ids[name]
    assert (saved / "latest").read_text().strip() == "step_00000004"


def test_resume_from_an_explicit_path_that_holds_nothing(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"checkpoint.resume={re.escape(repr(str(nowhere)))} does not"):
        _train(tmp_path / "ck", 2, f"checkpoint.resume={nowhere}")  # before any rank starts
    with pytest.raises((CheckpointError, RankFailedError)) as info:
        _train(tmp_path / "ck", 2, f"checkpoint.resume={tmp_path}")
    assert f"checkpoint.resume={str(tmp_path)!r} holds no checkpoint" in str(_cause(info))
    assert _resume(tmp_path / "fresh", 2).resumed_from is None  # resume=true, nothing saved: fresh


def test_a_resume_from_a_path_without_checkpoint_dir_says_it_saves_nothing(saved: Path) -> None:
    """dtlab train --set checkpoint.resume=<dir> alone (the resharding example) trains on and saves
    nothing: said at the start, with the setting to keep its steps."""
    res = _train(saved, 8, f"checkpoint.resume={saved}", "checkpoint.dir=null")
    assert res.resumed_from == str(saved / "step_00000006") and _steps(saved)[-1] == "step_00000006"
    said = [n for n in res.resume_notes if "checkpoint.dir is unset" in n]
    assert said == [
        "checkpoint.dir is unset: this run saves no checkpoint of the steps it trains after 6; set "
        "checkpoint.dir to keep them"
    ], res.resume_notes
