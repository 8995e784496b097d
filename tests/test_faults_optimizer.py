"""Changing the optimizer between a save and its resume: another class is refused naming both (or
started fresh with checkpoint.reset_optimizer=true), changed hyperparameters are listed and the
config's apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.errors import CheckpointError, RankFailedError
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import Trainer, TrainResult, run_training

BASE = [
    "backend.name=inmemory",
    "backend.world_size=2",
    *TINY_LM,
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=2",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.run_dir=null",
]


def _cfg(*extra: str) -> TrainConfig:
    return load_config(overrides=[*BASE, *extra])


def _resume(ck: Path, *extra: str) -> TrainResult:
    return run_training(_cfg(f"checkpoint.dir={ck}", "checkpoint.resume=true", "train.steps=6", *extra))[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 steps under SGD and under AdamW, each saved at step 4."""
    out = {}
    for name in ("sgd", "adamw"):
        ck = tmp_path_factory.mktemp(name) / "ck"
        run_training(_cfg(f"optimizer.name={name}", f"checkpoint.dir={ck}", "train.steps=4"))
        out[name] = ck
    return out


def _refused(ck: Path, *extra: str) -> str:
    with pytest.raises(RankFailedError) as info:
        _resume(ck, *extra)
    assert isinstance(info.value.__cause__, CheckpointError)
    return str(info.value.__cause__)


def test_another_optimizer_class_is_refused_naming_both(saved: dict[str, Path]) -> None:
    msg = _refused(saved["sgd"], "optimizer.name=adamw")  # was KeyError: 'exp_avg' on a rank
    assert "written with optimizer torch.optim.SGD, this run asks for torch.optim.AdamW" in msg
    assert "checkpoint.reset_optimizer=true" in msg
    msg = _refused(saved["adamw"], "optimizer.name=sgd")  # was: AdamW's moments silently dropped
    assert "torch.optim.AdamW, this run asks for torch.optim.SGD (optimizer.name='sgd')" in msg
    assert _steps(saved["sgd"]) == ["step_00000004"]  # nothing written by the refused runs


def _copy(ck: Path, tmp_path: Path) -> Path:
    """A copy to resume (and so write) in: the module's saved runs stay as saved whatever ran before."""
    import shutil

    return Path(shutil.copytree(ck, tmp_path / "ck"))


def _steps(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step_"))


def test_a_checkpoint_without_the_record_is_checked_from_its_config(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved["sgd"], ck)
    meta_path = ck / "step_00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["optimizer"] == {
        "class": "SGD",
        "hyperparameters": {"lr": 0.004, "momentum": 0.9, "weight_decay": 0.01},
    }
    del meta["optimizer"]  # as written before the record existed (meta.json carries no checksum)
    meta_path.write_text(json.dumps(meta))
    assert "torch.optim.SGD, this run asks for torch.optim.AdamW" in _refused(ck, "optimizer.name=adamw")


def test_reset_optimizer_starts_it_fresh_from_the_saved_parameters(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    reference = run_training(_cfg("optimizer.name=sgd", "train.steps=6"))[0].losses
    res = _resume(_copy(saved["sgd"], tmp_path), "optimizer.name=adamw", "checkpoint.reset_optimizer=true")
    assert res.start_step == 4
    assert any("reset_optimizer=true: the optimizer starts fresh as AdamW" in n for n in res.resume_notes)
    # step 5's loss is computed before any update: the parameters are the saved ones
    assert res.losses[0] == reference[4]
    assert res.losses[1] != reference[5]  # then AdamW, not SGD, takes the step


def _param_group(backend: CommunicationBackend, config: TrainConfig) -> tuple[dict[str, object], list[str]]:
    trainer = Trainer(config, backend)
    group = trainer.optimizer.optimizer.param_groups[0]
    return {k: group[k] for k in ("lr", "betas", "weight_decay")}, trainer.resume_notes


def test_changed_hyperparameters_are_listed_and_the_config_wins(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    ck = _copy(saved["adamw"], tmp_path)
    same = _cfg(f"checkpoint.dir={ck}", "checkpoint.resume=true", "train.steps=6")
    group, notes = run_world(2, _param_group, same)[0]
    assert group == {"lr": 0.004, "betas": (0.9, 0.99), "weight_decay": 0.01} and notes == []
    changed = _cfg(
        f"checkpoint.dir={ck}",
        "checkpoint.resume=true",
        "train.steps=6",
        "optimizer.lr=0.001",
        "optimizer.weight_decay=0.1",
        "optimizer.betas=[0.8, 0.95]",
    )
    group, notes = run_world(2, _param_group, changed)[0]
    # the constant schedule is past its warm-up: the lr is the config's
    assert group == {"lr": 0.001, "betas": (0.8, 0.95), "weight_decay": 0.1}
    assert notes == [
        "optimizer hyperparameters differ from the checkpoint's, the config's apply: lr 0.004 -> 0.001, "
        "betas [0.9, 0.99] -> [0.8, 0.95], weight_decay 0.01 -> 0.1"
    ]
    res = _resume(ck, "optimizer.lr=0.001")  # through run_training: the same note in the result
    assert res.resume_notes == [
        "optimizer hyperparameters differ from the checkpoint's, the config's apply: lr 0.004 -> 0.001"
    ]
