"""The losses README.md and docs/quickstart.md quote from deterministic runs (in-memory ranks, a fixed
seed: the same figures on every run on one machine) are today's: both pages quote the same run of
``dtlab train``, and the first loss each quotes (``dtlab train``'s default run, ``examples/train_ddp.py``,
``examples/train_fsdp.py``) is what one step of that run gives now. A change of the model's
initialisation, the data or the loss moves it; the full runs take minutes, so their later figures are
re-measured with the commands the docs give, not here."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import pytest

from dtlab.config import load_config
from dtlab.trainers import run_training

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ["train.steps=1", "train.eval_every=1", "train.eval_batches=1", "logging.plot=false"]


def _quoted(path: str, pattern: str) -> list[str]:
    found = re.search(pattern, (ROOT / path).read_text())
    assert found, f"{path}: no figure matching {pattern!r}"
    return list(found.groups())


def test_dtlab_train_default_run_figures() -> None:
    readme = _quoted("README.md", r"loss (\d\.\d{4}) -> (\d\.\d{4})\s+nats per byte")
    quickstart = _quoted("docs/quickstart.md", r"loss first -> last +(\d\.\d{4}) -> (\d\.\d{4})")
    progress = _quoted("docs/quickstart.md", r"progress 300/300 \(100%\) \| loss (\d\.\d{4})")
    assert readme == quickstart and progress[0] == quickstart[1]  # one run on both pages
    sets = ["train.steps=1", "train.eval_every=0", "logging.run_dir=null", "logging.progress=false"]
    result = run_training(load_config(overrides=sets))[0]
    assert f"{result.losses[0][1]:.4f}" == readme[0]


@pytest.mark.parametrize(
    ("example", "printed"),
    [("train_ddp", r"loss (\d\.\d+) -> "), ("train_fsdp", r"FSDP x 4: loss (\d\.\d+) -> ")],
    ids=["train_ddp", "train_fsdp"],
)
def test_an_examples_first_loss_is_the_quoted_one(
    example: str, printed: str, capsys: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    if example == "train_ddp":
        pytest.importorskip("sklearn")  # the digits
    (quoted,) = _quoted("docs/quickstart.md", rf"`python examples/{example}.py` \|[^|\n]*loss (\d\.\d+) -> ")
    monkeypatch.chdir(tmp_path)  # the example writes runs/ here
    runpy.run_path(str(ROOT / "examples" / f"{example}.py"))["main"]([*ONE_STEP, "logging.progress=false"])
    found = re.search(printed, capsys.readouterr().out)
    assert found, f"examples/{example}.py printed no first loss"
    assert f"{float(found.group(1)):.{len(quoted) - 2}f}" == quoted
