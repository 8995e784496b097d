"""A Hugging Face Llama from the CLI's config (``model.factory``, ``data.factory``) under tensor
parallelism: ``parallel.plan=auto`` (the model's own plan), an inline mapping and a YAML file, at tp 2
and at dp 2 x tp 2 with FSDP per decoder layer (``strategy.fsdp_units``); each run's losses against the
same config on one rank; a tp that splits a key/value head refused before any rank starts. Tiny configs
built in memory (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtlab.cli import main
from dtlab.config import load_config
from dtlab.errors import ConfigError
from dtlab.trainers.launch import run_training

BASE = ["backend.name=inmemory", "logging.progress=false", "logging.run_dir=null", "train.eval_every=0"]
BASE += ["data.global_batch_size=8", "optimizer.warmup_steps=0", "train.steps=3", "optimizer.lr=1e-2"]
BASE += ["model.factory=hf_cases:llama", "data.factory=hf_cases:tokens"]
# built plainly everywhere: a Hugging Face model built on the meta device (model.init's default where
# the plan shards) gets its _init_weights values, not the ones its constructor draws in the one-rank run
BASE += ["model.init=plain"]
HAND_PLAN = (
    "{model.embed_tokens: embedding_rowwise, 'model.layers.*.mlp.gate_proj': colwise, "
    "'model.layers.*.mlp.up_proj': colwise, 'model.layers.*.mlp.down_proj': rowwise}"
)


def _losses(sets: list[str]) -> list[float]:
    results = run_training(load_config(overrides=[*BASE, *sets]))
    return [loss for _, loss in results[0].losses]


@pytest.fixture
def tests_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.mark.usefixtures("tests_on_path")
def test_dtlab_train_runs_a_hugging_face_llama_at_tp2_like_one_rank(tmp_path: Path) -> None:
    ref = _losses(["backend.world_size=1"])
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("lm_head: colwise_gather_output\n'model.layers.*.self_attn.q_proj': colwise\n"
                         "'model.layers.*.self_attn.k_proj': colwise\n'model.layers.*.self_attn.v_proj': "
                         "colwise\n'model.layers.*.self_attn.o_proj': rowwise\n")  # fmt: skip
    runs = {
        "tp2 auto": ["backend.world_size=2", "parallel.tp=2"],
        "tp2 file": ["backend.world_size=2", "parallel.tp=2", f"parallel.plan={plan_file}"],
        "dp2 x tp2 fsdp": [
            "backend.world_size=4", "parallel.tp=2", "strategy.model=fsdp",
            "strategy.fsdp_units=[LlamaDecoderLayer]",
        ],
    }  # fmt: skip
    for name, sets in runs.items():
        got = _losses(sets)
        assert len(got) == len(ref) == 3, name
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) < 1e-5, (name, got, ref)
    # the CLI itself: plan auto is the default
    assert (
        main(["train", *[a for s in [*BASE, "backend.world_size=2", "parallel.tp=2"] for a in ("--set", s)]])
        == 0
    )


@pytest.mark.usefixtures("tests_on_path")
def test_a_plan_the_config_cannot_use_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    bad_file = tmp_path / "plan.yaml"
    bad_file.write_text("- colwise\n")
    for sets, says in [
        (["parallel.plan={lm_head: colwise}"], "is a tensor plan, but parallel.tp=1"),
        (["parallel.tp=2", "parallel.plan={lm_head: embedding_colwise}"], "'embedding_colwise' cannot be"),
        (["parallel.tp=2", f"parallel.plan={tmp_path / 'none.yaml'}"], "does not exist"),
        (["parallel.tp=2", f"parallel.plan={bad_file}"], "must hold a mapping"),
        (["parallel.tp=2", "parallel.plan=plan.json"], "a .yaml/.yml/.toml file"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_config(overrides=[*BASE, "backend.world_size=2", *sets])


@pytest.mark.usefixtures("tests_on_path")
def test_a_tp_that_splits_a_key_value_head_is_refused_before_any_rank_starts() -> None:
    config = load_config(
        overrides=[*BASE, "model.factory=hf_cases:llama_gqa", "backend.world_size=4", "parallel.tp=4"]
    )
    with pytest.raises(
        ConfigError, match=r"'model.layers.0.self_attn.k_proj' projects 2 attention heads of 8"
    ):
        run_training(config)  # a ConfigError from this process: no rank was started
