"""Unusable paths in the configuration: each fault one case, found before any rank starts (not at the
first save after all steps), as one ConfigError naming the field, the path and the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.config import TrainConfig, load_config
from dtlab.errors import ConfigError, RankFailedError
from dtlab.testing import TINY_LM, run_world, spawn_world
from dtlab.trainers import Trainer, run_training
from dtlab.trainers.preflight import check_paths_on_every_rank

BASE = [
    "backend.name=inmemory",
    "backend.world_size=2",
    *TINY_LM,
    "train.steps=2",
    "train.eval_every=0",
    "logging.progress=false",
]


def _cfg(*extra: str) -> TrainConfig:
    return load_config(overrides=[*BASE, *extra])


def test_unwritable_checkpoint_dir_fails_before_any_rank_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run_dir = tmp_path / "new" / "deeper" / "run"
    cfg = _cfg(f"checkpoint.dir={blocker / 'ck'}", f"logging.run_dir={run_dir}")
    with pytest.raises(ConfigError) as info:  # raised in the caller: no rank thread started
        run_training(cfg)
    msg = str(info.value)
    assert f"checkpoint.dir={str(blocker / 'ck')!r} cannot be created: Not a directory" in msg
    assert not (tmp_path / "new").exists()  # what the check created for logging.run_dir went again
    good = _cfg(f"checkpoint.dir={tmp_path / 'ck'}", f"logging.run_dir={run_dir}", "train.steps=1")
    from dtlab.trainers.preflight import check_paths

    check_paths(good)  # passes and leaves no trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_every_bad_path_is_named_in_one_error(tmp_path: Path) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("x")
    cfg = _cfg(f"checkpoint.dir={afile}", f"logging.run_dir={afile / 'sub'}")
    with pytest.raises(ConfigError) as info:
        run_training(cfg)
    msg = str(info.value)
    assert msg.startswith("unusable paths in the configuration: ")
    assert f"checkpoint.dir={str(afile)!r} exists and is not a directory" in msg
    assert f"logging.run_dir={str(afile / 'sub')!r} cannot be created: Not a directory" in msg


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_a_directory_that_cannot_be_created(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"logging.run_dir='/proc/dtlab-nope' cannot be created"):
        run_training(_cfg("logging.run_dir=/proc/dtlab-nope"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"checkpoint.dir=.* is not writable \(a probe file"):
            run_training(_cfg(f"checkpoint.dir={ro}", f"logging.run_dir={tmp_path / 'run'}"))
    finally:
        ro.chmod(0o755)


def test_the_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("x")
    sets = [*BASE, f"checkpoint.dir={afile / 'ck'}", f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtlab train: error: unusable path in the configuration: ")
    assert "checkpoint.dir=" in err[0] and "Not a directory" in err[0]


def test_a_resume_or_pretrained_path_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "ckpt-typo"
    sets = [*BASE, f"checkpoint.resume={missing}", "logging.run_dir=null"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 2  # before any rank starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtlab train: error: unusable path in the configuration: ")
    assert f"checkpoint.resume={str(missing)!r} does not exist" in err[0] and "or true to resume" in err[0]
    assert "choose directories" not in err[0]  # advice about directories to write does not fit here
    sets = [*BASE, f"model.pretrained={missing}.safetensors", "logging.run_dir=null"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtlab train: error: unusable path in the configuration: ")
    assert f"model.pretrained='{missing}.safetensors' does not exist: give a .safetensors file" in err[0]


def test_empty_paths_are_refused_by_the_config() -> None:
    for field, hint in (
        ("logging.run_dir", "or null for no metrics"),
        ("checkpoint.dir", "or null (dir)"),
        ("checkpoint.resume", "false (resume) to turn it off"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[f"{field}="])
        assert f"{field}='' is not allowed: an empty path" in str(info.value) and hint in str(info.value)


def _trainer(backend: CommunicationBackend, config: TrainConfig) -> None:
    Trainer(config, backend)


def test_the_trainer_checks_on_every_rank(tmp_path: Path) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("x")
    cfg = _cfg(f"checkpoint.dir={afile / 'ck'}", "logging.run_dir=null")
    with pytest.raises(RankFailedError) as info:  # a user's own rank function: the Trainer checks
        run_world(2, _trainer, cfg)
    assert isinstance(info.value.__cause__, ConfigError)
    assert "checkpoint.dir=" in str(info.value.__cause__)


def _in_own_directory(backend: CommunicationBackend, root: str, config: TrainConfig) -> str:
    here = Path(root) / f"rank{backend.rank}"
    here.mkdir()
    os.chdir(here)  # a relative checkpoint.dir now names another directory on each rank
    try:
        check_paths_on_every_rank(config, backend)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_checkpoint_dir_ranks_do_not_share_is_named(tmp_path: Path) -> None:
    cfg = _cfg("checkpoint.dir=ck", "logging.run_dir=null")
    errors = spawn_world(2, _in_own_directory, str(tmp_path), cfg, backend="gloo", timeout=60)
    assert errors[0] == errors[1]  # every rank raises the same error
    assert "checkpoint.dir='ck' is not the same directory on rank 1 as on rank 0" in errors[0]
    assert not (tmp_path / "rank0" / "ck").exists()  # rank 0's probe file and directory were removed
