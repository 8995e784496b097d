"""The config's ``parallel`` section: every invalid setting is one ConfigError naming the field, raised
while loading the config (in-memory worlds), by ``check_world_size`` (a launcher's world size) or, for
what fits the built-in model, when the run builds it; before any rank starts."""

from __future__ import annotations

import pytest

from dtlab.config import check_world_size, load_config
from dtlab.errors import ConfigError
from dtlab.parallel_config import run_plan
from dtlab.trainers import build_task

BASE = ["backend.name=inmemory", "backend.world_size=4"]

INVALID = [
    (["parallel.tp=0"], "parallel.tp=0"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tp > 1"),
    (["parallel.pp=2", "parallel.micro_batches=1"], "parallel.micro_batches=1 is fewer than parallel.pp=2"),
    (["parallel.pp=2", "parallel.schedule=interleaved_1f1b"], "parallel.schedule='interleaved_1f1b'"),
    (["parallel.pp=2", "data.accumulation_steps=2"], "data.accumulation_steps=2 with parallel.pp=2"),
    (["parallel.micro_batches=4"], "parallel.micro_batches=4 applies to pipelines"),
    (["parallel.split_points=[blocks.1]"], "parallel.split_points=['blocks.1'] cuts pipeline stages"),
    (["parallel.stages_per_rank=2"], "parallel.stages_per_rank=2 applies to pipelines"),
    (["parallel.dp=3", "parallel.tp=2"], "parallel.dp=3 x parallel.tp=2 x parallel.pp=1 = 6 ranks"),
    (["parallel.tp=2", "parallel.pp=2", "backend.world_size=6"], "= 4 does not divide the world of 6"),
    (
        ["parallel.tp=2", "backend.world_size=8", "data.global_batch_size=6"],
        "data.global_batch_size=6 is not divisible by the dp axis",
    ),
    (
        ["parallel.pp=2", "parallel.micro_batches=4", "data.global_batch_size=12"],
        "not divisible into parallel.micro_batches=4",
    ),
    # deprecated spellings keep their old rules
    (["strategy.model=tensor", "parallel.pp=2"], "strategy.model='tensor' runs on the dp x tp mesh"),
    (["strategy.model=pipeline", "parallel.tp=2"], "strategy.model='pipeline' runs on the pp x dp mesh"),
    (
        ["parallel.tp=2", "model.name=digits_cnn", "data.dataset=digits"],
        "not model.name='digits_cnn'",
    ),
    (["parallel.tp=2", "elastic.commit_every=2"], "elastic.commit_every=2 with parallel.tp=2"),
]


@pytest.mark.parametrize(("overrides", "needle"), INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_every_invalid_parallel_setting_is_named(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[*BASE, *overrides])
    assert needle in str(info.value), str(info.value)


# the built-in transformer's own sizes and declaration (its tp_plan() and pipeline blocks, built on the
# meta device): checked when a run builds it, before any rank starts, not at config load (the same
# config may train a model of your own, tests/test_custom_model_pipeline.py)
BUILTIN = [
    # the model's own declaration (its tp_plan(), built on the meta device) decides what tp fits
    (
        ["parallel.tp=4", "model.n_heads=2"],
        "do not fit TransformerLM: tensor-parallel plan: module 'blocks.0.attn': the number of attention "
        "heads is 2, not divisible by tp=4",
    ),
    (
        ["parallel.tp=6", "backend.world_size=6", "model.n_heads=6", "model.d_model=48"],
        "parallel.tp=6, parallel.pp=1 do not fit TransformerLM: tensor-parallel plan: module 'tok': the "
        "vocabulary (num_embeddings) is 256, not divisible by tp=6",
    ),
    (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=33"],
        "model.seq_len=33 is not divisible by 2",
    ),
    (["parallel.pp=4", "model.n_layers=2"], "= 4 stages do not divide model.n_layers=2"),
    (["parallel.pp=2", "model.n_layers=3"], "= 2 stages do not divide model.n_layers=3"),
    (["parallel.pp=2", "parallel.split_points=[nope]"], "parallel.split_points=['nope']"),
    (["parallel.pp=2", "parallel.split_points=[embed]"], "parallel.split_points=['embed']"),
]


@pytest.mark.parametrize(("overrides", "needle"), BUILTIN, ids=[" ".join(o) for o, _ in BUILTIN])
def test_what_does_not_fit_the_builtin_model_is_named_when_it_is_built(
    overrides: list[str], needle: str
) -> None:
    config = load_config(overrides=[*BASE, *overrides])
    with pytest.raises(ConfigError) as info:
        build_task(config)
    assert needle in str(info.value), str(info.value)


def test_the_launchers_world_size_is_checked_against_the_mesh() -> None:
    config = load_config(overrides=["backend.name=gloo", "parallel.tp=2", "parallel.pp=2"])
    check_world_size(config, 8)  # dp = 2
    with pytest.raises(ConfigError, match=r"does not divide the world of 6 ranks"):
        check_world_size(config, 6)
    config = load_config(overrides=["backend.name=mpi", "parallel.tp=2", "parallel.dp=2"])
    with pytest.raises(ConfigError, match=r"parallel.dp=2 x parallel.tp=2 x parallel.pp=1 = 4 ranks"):
        check_world_size(config, 8)


def test_valid_meshes_resolve_dp() -> None:
    config = load_config(overrides=[*BASE, "backend.world_size=8", "parallel.tp=2", "parallel.pp=2"])
    plan = run_plan(config, 8)
    assert plan.mesh_shape == {"pp": 2, "dp": 2, "tp": 2} and plan.micro_batch_count == 2
    config = load_config(overrides=[*BASE, "parallel.pp=2", "parallel.split_points=[blocks.1]"])
    assert config.parallel.split_points == ["blocks.1"]
