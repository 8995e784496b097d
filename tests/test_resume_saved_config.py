"""A checkpoint's ``meta.json`` is untrusted: a saved config whose sections are not objects (``"train":
5``) reaches the resume's reads of the saved ``train.steps`` and ``parallel.tp`` as a CheckpointError
or as an unknown value, never as a raw AttributeError on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtlab.config import TrainConfig, load_config
from dtlab.errors import RankFailedError
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    sets = ["backend.name=inmemory", "backend.world_size=2", *TINY_LM, "train.eval_every=0"]
    sets += [
        "optimizer.schedule=torch",
        "optimizer.warmup_steps=0",
        "optimizer.torch_scheduler=CosineAnnealingLR",
    ]
    return load_config(overrides=[*sets, "logging.progress=false", f"logging.run_dir={tmp / 'run'}", *extra])


def test_a_saved_config_of_another_shape_is_no_raw_error_on_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run_training(_cfg(tmp_path, "train.steps=4", f"checkpoint.dir={ck}", "checkpoint.every=2"))
    meta = ck / "step_00000002" / "meta.json"
    saved = json.loads(meta.read_text())
    saved["config"]["train"], saved["config"]["parallel"] = 5, 5
    meta.write_text(json.dumps(saved))
    resume = f"checkpoint.resume={ck / 'step_00000002'}"
    with pytest.raises(
        RankFailedError, match=r"CheckpointError: .*T_max=4, this run builds T_max=6; a torch"
    ):
        run_training(_cfg(tmp_path, "train.steps=6", resume))
    assert run_training(_cfg(tmp_path, "train.steps=4", resume))[0].final_step == 4
