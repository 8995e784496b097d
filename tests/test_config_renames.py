"""Renamed config fields: the old names still work, with a deprecation warning naming the new one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtlab.config import RENAMED, load_config
from dtlab.errors import ConfigError


@pytest.mark.parametrize(("section", "old"), sorted(RENAMED))
def test_old_name_is_read_with_a_warning(section: str, old: str) -> None:
    new = RENAMED[(section, old)]
    with pytest.warns(FutureWarning, match=rf"{section}\.{old} is deprecated: it is now {section}\.{new}"):
        cfg = load_config(overrides=[f"{section}.{old}=7"])
    assert getattr(getattr(cfg, section), new) == 7
    assert old not in cfg.to_dict()[section] and cfg.to_dict()[section][new] == 7
    with pytest.raises(ConfigError, match=rf"both are set: keep only {section}\.{new}"):
        load_config(overrides=[f"{section}.{old}=7", f"{section}.{new}=8"])


def test_new_names_and_their_defaults() -> None:
    from dtlab.compression import PowerSGD

    cfg = load_config(overrides=["compression.algorithm=powersgd", "compression.powersgd_rank=2"])
    assert cfg.compression.powersgd_rank == 2 and cfg.compression.dense_warmup_steps == 10
    assert cfg.strategy.bucket_cap_mb == 25.0
    assert PowerSGD(rank=2).rank == 2  # the Python class keeps its own name


def test_the_program_prints_the_warning_as_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab", "config", "--set", "strategy.bucket_mb=10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "bucket_cap_mb: 10.0" in proc.stdout
    assert proc.stderr == (
        "dtlab config: warning: strategy.bucket_mb is deprecated: it is now strategy.bucket_cap_mb "
        "(the old name still works for now)\n"
    )  # not the raising module's path, line number and source line
