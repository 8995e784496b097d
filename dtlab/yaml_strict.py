"""YAML for config files with one rule PyYAML's ``safe_load`` lacks: a key given twice in the same
mapping is an error naming it and both lines (``safe_load`` silently keeps the last value)."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load_yaml"]


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice."""


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:  # the keys written here; ``<<`` merges may be overridden, as YAML says
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKeyError(
                f"key {key!r} appears twice in the same mapping (lines {seen[key]}, {line}); keep one of them"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (:class:`DuplicateKeyError`, a ``YAMLError``)."""
    return yaml.load(text, Loader=_StrictLoader)
