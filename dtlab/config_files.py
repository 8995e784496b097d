"""Reading configuration files: bounded in size (:data:`MAX_CONFIG_BYTES`), depth and values
(:data:`CONFIG_LIMITS`), YAML (a key given twice refused) or TOML; every problem one
:class:`~dtlab.errors.ConfigError` naming the file. Read by :mod:`dtlab.config` and, for a tensor plan
in a file (``parallel.plan``), :mod:`dtlab.parallel_config`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from dtlab.errors import ConfigError
from dtlab.untrusted import TreeLimits, measure_tree

__all__ = ["CONFIG_LIMITS", "MAX_CONFIG_BYTES", "check_tree", "read_mapping_file", "read_text"]

#: the largest config file read (a real one is a few kilobytes)
MAX_CONFIG_BYTES = 1 << 20
#: how deep, how many values (aliases expanded) and how long a string a config may hold
CONFIG_LIMITS = TreeLimits(depth=16, nodes=100_000, string=4096)


def read_text(p: Path) -> str:
    """The file's text: at most ``MAX_CONFIG_BYTES`` read (the size checked on the open file), UTF-8."""
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(MAX_CONFIG_BYTES + 1) if size <= MAX_CONFIG_BYTES else b""
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    if size > MAX_CONFIG_BYTES or len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {str(p)!r} is {max(size, len(data)):,} bytes; dtlab reads config files of at "
            f"most {MAX_CONFIG_BYTES:,} bytes (a configuration is a few kilobytes)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); "
            "save it as UTF-8"
        ) from None


def read_mapping_file(path: str | Path) -> dict[str, Any]:
    """The mapping a ``.yaml``/``.yml``/``.toml`` file holds, read under :data:`MAX_CONFIG_BYTES` and
    :data:`CONFIG_LIMITS` (a config file; ``parallel.plan`` may name such a file too)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = read_text(p)
    if p.suffix == ".toml":
        import importlib

        try:
            tomllib = importlib.import_module("tomllib")
        except ModuleNotFoundError:  # Python 3.10
            try:
                tomllib = importlib.import_module("tomli")
            except ModuleNotFoundError:
                raise ConfigError(
                    f"config file {str(p)!r}: reading TOML needs Python 3.11+ or `pip install tomli`; "
                    "or use a .yaml file"
                ) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
        except (
            RecursionError
        ):  # tomllib parses nested arrays and tables recursively, with no limit of its own
            raise ConfigError(
                f"config file {str(p)!r}: arrays or tables nested deeper than Python can parse (at most "
                f"{CONFIG_LIMITS.depth} levels are read); a configuration is a few levels deep"
            ) from None
    elif p.suffix in (".yaml", ".yml"):
        from dtlab.yaml_strict import DuplicateKeyError, NestingError, load_yaml

        try:
            data = load_yaml(text, CONFIG_LIMITS.depth, CONFIG_LIMITS.nodes) or {}
        except (DuplicateKeyError, NestingError) as exc:
            raise ConfigError(f"config file {str(p)!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    else:
        raise ConfigError(f"config file {str(p)!r}: use a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


def check_tree(tree: Any, where: str = "the configuration") -> None:
    """A :class:`ConfigError` when ``tree`` is deeper, larger (aliases expanded) or holds a longer
    string than :data:`CONFIG_LIMITS` allows: checked before any value of it is used."""
    problem = measure_tree(tree, CONFIG_LIMITS)
    if problem is not None:
        raise ConfigError(
            f"{where} holds {problem}; limits: {CONFIG_LIMITS.depth} levels, {CONFIG_LIMITS.nodes:,} "
            f"values, strings of {CONFIG_LIMITS.string:,} characters"
        )
