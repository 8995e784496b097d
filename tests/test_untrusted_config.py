"""Configs from elsewhere: bounded work and one named error (exit 2) for any file or override.

The command lines run in one child process under an address-space cap (``tests/_capped.py``) well
under what the inputs would take if expanded or read whole: an alias bomb that expands to 387 million
items, a 4 GiB config file (sparse), YAML and TOML nested 100,000 deep.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from dtlab.config import CONFIG_LIMITS, apply_overrides, from_dict, load_config
from dtlab.errors import ConfigError
from dtlab.untrusted import TreeLimits, measure_tree, summary
from tests._capped import run_cli

_BOMB = "\n".join(
    [
        'l0: &l0 ["x","x","x","x","x","x","x","x","x"]',
        *[f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)],
        "optimizer:",
        "  schedule: torch",
        "  torch_scheduler: StepLR",
        f"  torch_scheduler_args: {{step_size: [{', '.join(['*l8'] * 9)}]}}",
    ]
)


def test_a_summary_is_bounded_whatever_the_value() -> None:
    tree = yaml.safe_load(_BOMB)  # shared lists: 9**9 items once expanded
    t0 = time.perf_counter()
    text = summary(tree["optimizer"]["torch_scheduler_args"])
    huge = summary("a" * 55_000_000)
    assert time.perf_counter() - t0 < 1.0
    assert len(text) < 200 and text.startswith("a dict of 1 entries: {'step_size': [[[[")
    assert len(huge) < 200 and "55,000,000 characters" in huge
    assert summary(2**100_000).startswith("<int of 100001 bits>")
    assert summary("adamw") == "'adamw'" and summary(3) == "3"


def test_measure_tree_counts_aliases_and_refuses_depth_and_cycles() -> None:
    limits = TreeLimits(depth=8, nodes=1000, string=10)
    assert measure_tree({"a": [1, 2, {"b": "short"}]}, limits) is None
    shared = list(range(10))
    assert "more than 1,000 values" in str(measure_tree([shared] * 200, limits))
    deep: list[object] = []
    node = deep
    for _ in range(50):
        child: list[object] = []
        node.append(child)
        node = child
    assert "nested deeper than 8 levels" in str(measure_tree(deep, limits))
    loop: list[object] = []
    loop.append(loop)
    assert "contains itself" in str(measure_tree({"k": loop}, limits))
    assert "a string of 11 characters at k" in str(measure_tree({"k": "x" * 11}, limits))


def test_the_error_message_summarises_a_shared_value() -> None:
    """A field given a value that shares an alias: the message names the field and stays short."""
    with pytest.raises(ConfigError) as info:
        from_dict({"train": {"steps": [list(range(20))] * 20}})
    msg = str(info.value)
    assert "train.steps=a list of 20 items" in msg and len(msg) < 400


def test_overrides_are_bounded_like_files() -> None:
    with pytest.raises(ConfigError, match="nested deeper than 16 levels"):
        apply_overrides({}, ["optimizer.torch_scheduler_args={a: " + "[" * 40 + "]" * 40 + "}"])
    with pytest.raises(ConfigError, match="characters long; at most 4,096"):
        apply_overrides({}, ["checkpoint.dir=/tmp/" + "a" * 6000])
    with pytest.raises(ConfigError, match="less than or equal to 1048576"):
        load_config(None, ["model.seq_len=100000000"])
    assert CONFIG_LIMITS.depth == 16


def test_bad_config_files_are_one_named_error_under_a_memory_cap(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(_BOMB)
    (tmp_path / "deep.yaml").write_text("a:\n  x: " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "latin1.yaml").write_bytes("train:\n  steps: 3 # é\n".encode("latin-1"))
    with open(tmp_path / "huge.yaml", "wb") as f:  # sparse: 4 GiB of zeros that take no disk
        f.truncate(4 << 30)
    (tmp_path / "long.yaml").write_text(
        "optimizer:\n  torch_scheduler_args:\n    k: '" + "a" * 600_000 + "'\n"
    )
    (tmp_path / "flat.yaml").write_text("a: [" + ",".join(["1"] * 400_000) + "]\n")  # 800 kB
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(7)\ndef build():\n    pass\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    cases = [
        ["config", "-c", "bomb.yaml"],
        ["config", "-c", "deep.yaml"],
        ["config", "-c", "deep.toml"],
        ["config", "-c", "latin1.yaml"],
        ["config", "-c", "huge.yaml"],
        ["config", "-c", "long.yaml"],
        ["config", "-c", "flat.yaml"],
        ["config", "--set", "model.seq_len=1e8"],
        ["train", "--set", "checkpoint.dir=" + "d" * 6000],
        ["train", "--set", "checkpoint.dir=" + "d" * 300, "--set", "logging.run_dir=null"],
        ["train", "--set", "model.factory=exits:build", "--set", "logging.run_dir=null"],
        ["train", "--set", "model.seq_len=500000", "--set", "logging.run_dir=null"],
    ]
    expected = [
        "holds more than 100,000 values once shared values (YAML aliases) are expanded",
        "nested deeper than 16 levels",
        "nested deeper than Python can parse",
        "is not UTF-8 text (byte 20 is 0xe9)",
        "is 4,294,967,296 bytes; dtlab reads config files of at most 1,048,576 bytes",
        "holds a string of 600,000 characters at optimizer.torch_scheduler_args.k",
        "more than 100,000 values (mappings, lists and scalars)",
        "model.seq_len='1e8' is not allowed",
        "is 6,015 characters long; at most 4,096 are read",
        "checkpoint.dir='" + "d" * 300 + "' cannot be created: File name too long",
        "importing 'exits' called sys.exit(7)",
        "model.seq_len=500000 does not fit data.max_bytes=1000000",
    ]
    results = run_cli(cases, cwd=tmp_path)
    for result, want in zip(results, expected, strict=True):
        err = result["stderr"]
        assert result["rc"] == 2, result
        assert want in err, (want, err[-1500:])
        assert "Traceback" not in err and len(err) < 2000, err[-1500:]
    assert outside.read_text() == "keep"
    assert not any(p.name.startswith("d" * 100) for p in tmp_path.iterdir())
    assert os.path.getsize(tmp_path / "huge.yaml") == 4 << 30
