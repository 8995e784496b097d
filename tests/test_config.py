"""TrainConfig: defaults, YAML/TOML files, --set overrides, and one clear message per invalid value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.config import TrainConfig, check_world_size, load_config
from dtlab.errors import ConfigError


def test_defaults_are_the_embedded_default() -> None:
    c = load_config()
    assert c == TrainConfig()
    assert c.backend.name == "auto" and c.backend.world_size == 4
    assert c.model.name == "transformer_lm" and c.data.dataset == "stdlib"
    assert c.strategy.optimizer_name == "ddp"
    assert load_config(overrides=["strategy.model=fsdp"]).strategy.optimizer_name == "zero3"


def test_yaml_and_toml_files_and_overrides(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("strategy:\n  model: zero2\noptimizer:\n  lr: 0.01\n")
    t = tmp_path / "c.toml"
    t.write_text('[strategy]\nmodel = "zero2"\n[optimizer]\nlr = 0.01\n')
    for path in (y, t):
        c = load_config(path, ["optimizer.lr=2e-3", "train.precision=bf16", "checkpoint.dir=null"])
        assert c.strategy.model == "zero2"
        assert c.optimizer.lr == pytest.approx(2e-3)
        assert c.train.precision == "bf16" and c.checkpoint.dir is None
    assert load_config(overrides=["optimizer.betas=[0.8, 0.9]"]).optimizer.betas == (0.8, 0.9)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["compression.density=2"], ["compression.density", "2", "(0, 1]"]),
        (["compression.density=0"], ["compression.density", "0", "(0, 1]"]),
        (["compression.density=-0.5"], ["compression.density", "-0.5", "(0, 1]"]),
        (
            ["compression.algorithm=oktopk", "compression.momentum_correction=true"],
            ["compression.momentum_correction", "optimizer.name=sgd", "'adamw'"],
        ),
        (["compression.momentum_correction=true"], ["compression.algorithm", "'none'"]),
        (["compression.ramp_steps=-3"], ["compression.ramp_steps", "-3", "greater than or equal to 0"]),
        (["strategy.model=zero4"], ["strategy.model", "zero4", "'fsdp'"]),
        (["strategy.optimizer=adam"], ["strategy.optimizer", "adam", "'zero3'"]),
        (["compression.algorithm=magic"], ["compression.algorithm", "magic", "'oktopk'"]),
        (["backend.name=tcp"], ["backend.name", "tcp", "'mpi'"]),
        (
            ["strategy.model=ddp", "strategy.optimizer=zero3"],
            ["strategy.optimizer", "zero3", "strategy.model"],
        ),
        (["strategy.model=fsdp", "strategy.optimizer=zero1"], ["strategy.optimizer", "zero1", "['zero3']"]),
        (
            ["backend.name=inmemory", "data.global_batch_size=30"],
            ["data.global_batch_size=30", "4 x 1 = 4", "multiple of 4"],
        ),
        (
            ["backend.name=inmemory", "data.accumulation_steps=3"],
            ["data.global_batch_size=32", "data.accumulation_steps", "12"],
        ),
        (["optimizer.lr=-1"], ["optimizer.lr", "-1", "greater than 0"]),
        (["model.n_heads=3"], ["model.d_model", "model.n_heads=3"]),
        (["model.name=digits_cnn"], ["model.name", "data.dataset"]),
        (["train.steps=many"], ["train.steps", "many"]),
        (["model.bogus=1"], ["model.bogus", "unknown field", "n_heads"]),
        (["optimizer.betas=[1.5, 0.9]"], ["optimizer.betas", "1.5", "[0, 1)"]),
        (["optimizer.betas=0.9"], ["optimizer.betas=0.9 is not allowed", "two numbers", "[0.9, 0.99]"]),
        (["optimizer.betas=[0.9]"], ["optimizer.betas=[0.9] is not allowed", "two numbers"]),
        (["optimizer.shedule=cosine"], ["optimizer.shedule", "did you mean optimizer.schedule?"]),
        (["optimzer.lr=1e-3"], ["optimzer: unknown field", "did you mean optimizer?"]),
        (["train.lr=1e-3"], ["train.lr: unknown field", "did you mean optimizer.lr?"]),
        (["data.batch_size=8"], ["data.batch_size", "did you mean data.global_batch_size?"]),
        (["steps=10"], ["steps: unknown field", "did you mean train.steps?"]),  # the section left out
        (["data.max_bytes=1e6"], ["data.max_bytes='1e6' is not allowed", "write it as digits: 1000000"]),
        (["strategy.fsdp_units=Block"], ["strategy.fsdp_units='Block'", "write a list, e.g. [Block]"]),
        (  # a config-only mismatch: refused with the config, not on one rank after the world started
            ["strategy.fsdp_units=[Block]"],
            ["strategy.fsdp_units=['Block'] names FSDP units", "'ddp'; use strategy.model=fsdp"],
        ),
        (["optimizer.lr=.inf"], ["optimizer.lr=inf", "finite"]),
        (["compression.density=.nan"], ["compression.density=nan", "finite"]),
        (["strategy=fsdp"], ["strategy='fsdp'", "is a section", "strategy.model"]),
        (["strategy.model.kind=ddp"], ["strategy.model={'kind': 'ddp'}", "'fsdp'"]),
        (
            ["optimizer.schedule=torch", "optimizer.torch_scheduler=LambdaLR"],
            ["optimizer.torch_scheduler='LambdaLR'", "'OneCycleLR'"],
        ),
        (
            ["optimizer.schedule=torch", "optimizer.torch_scheduler=OneCycleLR"],
            ["optimizer.torch_scheduler_args={}", "max_lr"],
        ),
        (
            [
                "optimizer.schedule=torch",
                "optimizer.torch_scheduler=StepLR",
                "optimizer.torch_scheduler_args={step_size: 2, gama: 0.5}",
            ],
            ["optimizer.torch_scheduler_args=", "'gama'", "step_size, gamma"],
        ),
        (
            ["optimizer.torch_scheduler=StepLR"],
            ["optimizer.torch_scheduler='StepLR'", "optimizer.schedule=torch"],
        ),
        (["optimizer.schedule=torch"], ["optimizer.schedule='torch'", "optimizer.torch_scheduler"]),
        (
            [
                "optimizer.schedule=torch",
                "optimizer.torch_scheduler=CosineAnnealingLR",
                "optimizer.warmup_steps=5",
            ],
            ["optimizer.warmup_steps=5", "pct_start"],
        ),
    ],
)
def test_invalid_values_name_the_field(overrides: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_world_size_check_and_malformed_overrides(tmp_path: Path) -> None:
    c = load_config(overrides=["data.global_batch_size=18", "data.accumulation_steps=3"])
    check_world_size(c, 2)  # 18 = 2 x 3 x 3
    with pytest.raises(ConfigError, match=r"data.global_batch_size=18 .* 4 x 3 = 12"):
        check_world_size(c, 4)
    with pytest.raises(ConfigError, match="has no '='"):
        load_config(overrides=["train.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml or \.toml"):
        load_config(bad)


def test_cli_rejects_bad_density_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab", "train", "--set", "compression.density=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "compression.density=2" in proc.stderr and "(0, 1]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_field_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for section, field in TrainConfig.model_fields.items():
        assert f"### `{section}`" in doc, section
        sub = field.annotation
        assert sub is not None
        for name in sub.model_fields:
            assert f"| `{name}` |" in doc, f"{section}.{name} is missing from docs/configuration.md"


def test_cli_rejects_an_indivisible_global_batch_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.cli import main

    # backend.name=auto without a launcher: 4 in-memory ranks, checked before the corpus is read
    assert main(["train", "--set", "data.global_batch_size=30", "--set", "logging.run_dir=null"]) == 2
    err = capsys.readouterr().err
    assert "data.global_batch_size=30" in err and "4 x 1 = 4" in err and "multiple of 4" in err
