"""``model.init`` and ``model.pretrained`` from the config: a tiny Hugging Face Llama (the factory of
test_hf_models) written by ``save_pretrained`` is built on meta under FSDP (the default there) or
plainly under DDP, loaded bitwise, and trains from the CLI; meta is refused where every rank holds the
whole model; the run header says how the model was built and its construction peak."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.cli import main
from dtlab.config import TrainConfig, load_config
from dtlab.core import seeded_init
from dtlab.errors import ConfigError, RankFailedError
from dtlab.testing import run_world
from dtlab.trainers import build_task
from dtlab.trainers.build import build_model

pytest.importorskip("transformers")

BASE = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
BASE += ["data.global_batch_size=8", "train.eval_every=0", "optimizer.warmup_steps=0"]
BASE += ["model.factory=hf_cases:llama", "data.factory=hf_cases:tokens"]


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from hf_cases import llama

    with seeded_init(123):  # not train.seed: the loaded values must come from the file
        net = llama()
    net.save_pretrained(folder)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _built(backend: CommunicationBackend, config: TrainConfig) -> tuple[str, dict[str, torch.Tensor], int]:
    built = build_model(config, backend, build_task(config))
    c = built.construction
    return c.init, built.model.full_state_dict(), c.peak_bytes


def test_model_pretrained_loads_into_a_model_built_on_meta_or_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    saved = _saved(tmp_path / "llama")
    fsdp = [*BASE, "strategy.model=fsdp", "strategy.fsdp_units=[LlamaDecoderLayer]"]
    for sets, init in [(fsdp, "meta"), ([*BASE, "strategy.model=ddp"], "plain")]:
        config = load_config(overrides=[*sets, f"model.pretrained={tmp_path / 'llama'}"])
        for got, full, peak in run_world(2, _built, config, timeout=120):
            assert got == init
            assert [k for k in saved if not torch.equal(full[k], saved[k])] == [], init
            assert peak > 0
    whole = run_world(2, _built, load_config(overrides=[*fsdp, "model.init=plain"]), timeout=120)
    meta = run_world(2, _built, load_config(overrides=fsdp), timeout=120)
    assert whole[0][0] == "plain" and meta[0][0] == "meta"
    assert meta[0][2] < whole[0][2]  # the share and one module, not the whole model

    # the whole run from the CLI, from the pretrained weights
    run = [*fsdp, f"model.pretrained={tmp_path / 'llama'}", "train.steps=2", "logging.progress=true"]
    assert main(["train", *[a for s in run for a in ("--set", s)]]) == 0
    cap = capsys.readouterr()
    head = next(
        line for line in (cap.out + cap.err).splitlines() if line.startswith("dtlab train: ") and "|" in line
    )
    assert "built on meta: peak " in head and "largest module" in head, head


def test_meta_is_refused_where_every_rank_holds_the_whole_model_and_a_missing_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    for bad, says in [
        (
            ["strategy.model=ddp", "model.init=meta"],
            r"model\.init=meta .* strategy\.model=ddp without parallel\.tp/parallel\.pp keeps the whole",
        ),
        (
            ["strategy.model=zero3", f"model.pretrained={tmp_path / 'nope'}"],
            r"model\.pretrained=.*nope.* does not",
        ),
    ]:
        with pytest.raises(RankFailedError) as info:
            run_world(1, _built, load_config(overrides=[*BASE, *bad]), timeout=60)
        assert isinstance(info.value.__cause__, ConfigError)
        assert re.search(says, str(info.value.__cause__)), info.value.__cause__
