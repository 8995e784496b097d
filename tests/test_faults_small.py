"""Small faults, each one case: a clear error naming the value (never a raw TypeError, never a value
taken silently). The paths (empty logging.run_dir, ...) are in test_faults_paths.py, the checkpoint
pointer faults (stale .tmp-latest-*, latest outside the directory) in test_faults_resume.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtlab.cli import main
from dtlab.config import load_config
from dtlab.errors import ArgumentError, ArgumentTypeError, ConfigError
from dtlab.testing import run_world, spawn_world


def _rank(backend: Any) -> int:
    return int(backend.rank)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1.0])
def test_run_world_refuses_a_timeout_that_bounds_nothing(timeout: float) -> None:
    with pytest.raises(ArgumentError, match=r"run_world: timeout must be a finite number of seconds > 0"):
        run_world(2, _rank, timeout=timeout)


@pytest.mark.parametrize("world_size", [1.5, "2", True, 2.0])
def test_run_world_refuses_a_world_size_that_is_not_an_int(world_size: Any) -> None:
    with pytest.raises(ArgumentTypeError, match=r"run_world: world_size must be an int, got"):
        run_world(world_size, _rank)
    assert issubclass(ArgumentTypeError, TypeError)  # still a TypeError, now one that says why


def test_spawn_world_checks_the_same_before_starting_anything() -> None:
    with pytest.raises(ArgumentTypeError, match=r"spawn_world: world_size must be an int, got '2'"):
        spawn_world("2", _rank)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=r"spawn_world: timeout must be a finite"):
        spawn_world(2, _rank, timeout=float("nan"))
    with pytest.raises(ArgumentError, match=r"spawn_world: backend_timeout must be a finite"):
        spawn_world(2, _rank, backend_timeout=float("inf"))
    assert run_world(2, _rank, timeout=5) == [0, 1]  # the normal case is untouched


@pytest.mark.parametrize(
    ("override", "kind"),
    [
        ("train.steps=true", "an integer"),
        ("optimizer.lr=false", "a number"),
        ("backend.timeout=true", "a number"),
    ],
)
def test_a_bool_is_not_a_number(override: str, kind: str) -> None:
    field, _, value = override.partition("=")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert f"{field}={value.capitalize()} is not allowed: a bool is not a number here; give {kind}" in str(
        info.value
    )


def test_bools_stay_bools_and_the_cli_refuses_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(overrides=["data.shuffle=false", "checkpoint.resume=true", "train.steps=7"])
    assert cfg.data.shuffle is False and cfg.checkpoint.resume is True and cfg.train.steps == 7
    assert main(["train", "--set", "train.steps=true"]) == 2
    assert "train.steps=True is not allowed: a bool is not a number here" in capsys.readouterr().err


def test_duplicate_yaml_keys_are_refused_naming_the_key(tmp_path: Path) -> None:
    twice = "appears twice in the same mapping"
    cases = {
        "optimizer:\n  lr: 0.001\n  name: sgd\n  lr: 0.002\n": f"key 'lr' {twice} (lines 2, 4)",
        "train:\n  steps: 5\nmodel:\n  n_layers: 1\ntrain:\n  seed: 1\n": f"key 'train' {twice} (lines 1, 5)",
    }
    for text, needle in cases.items():
        path = tmp_path / "run.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == f"config file {str(path)!r}: {needle}; keep one of them"
    # a YAML merge (<<) may be overridden: that is not a duplicate
    from dtlab.yaml_strict import load_yaml

    assert load_yaml("a: &b {lr: 1, name: sgd}\noptimizer:\n  <<: *b\n  lr: 2\n")["optimizer"] == {
        "lr": 2,
        "name": "sgd",
    }
    # TOML refuses duplicates itself
    toml = tmp_path / "run.toml"
    toml.write_text("[optimizer]\nlr = 0.1\nlr = 0.2\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(toml)


def test_torch_scheduler_args_without_a_torch_schedule_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["optimizer.torch_scheduler_args={T_max: 5}"])
    assert "optimizer.torch_scheduler_args={'T_max': 5} would be ignored" in str(info.value)
    assert "(it is 'cosine')" in str(info.value)
    cfg = load_config(
        overrides=[
            "optimizer.schedule=torch",
            "optimizer.warmup_steps=0",
            "optimizer.torch_scheduler=CosineAnnealingLR",
            "optimizer.torch_scheduler_args={T_max: 5}",
        ]
    )
    assert cfg.optimizer.torch_scheduler_args == {"T_max": 5}
