"""YAML for config files with two rules PyYAML's ``safe_load`` lacks: a key given twice in the same
mapping is an error naming it and both lines (``safe_load`` silently keeps the last value), and
nesting deeper than a limit is refused before the document is composed (PyYAML composes nodes
recursively: a document nested 100,000 deep would end in a ``RecursionError``). Aliases stay shared
as PyYAML builds them; :func:`dtlab.untrusted.measure_tree` counts them expanded."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "NestingError", "load_yaml"]


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice."""


class NestingError(yaml.YAMLError):
    """The document nests mappings and sequences deeper than the limit."""


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


def _check_depth(text: str, max_depth: int, max_nodes: int) -> None:
    """Walk the event stream (no recursion) and stop at the first collection ``max_depth`` deep, or
    after ``max_nodes`` values (before composing them: PyYAML builds a node per value, slowly)."""
    depth = 0
    for count, event in enumerate(yaml.parse(text, Loader=yaml.SafeLoader)):
        if count > max_nodes:
            raise NestingError(
                f"more than {max_nodes:,} values (mappings, lists and scalars); a configuration holds "
                "a few hundred"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > max_depth:
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise NestingError(
                    f"mappings and lists nested deeper than {max_depth} levels (line {line}); "
                    "a configuration is a few levels deep"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(text: str, max_depth: int = 32, max_nodes: int = 1_000_000) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (:class:`DuplicateKeyError`), collections
    nested deeper than ``max_depth`` and more than ``max_nodes`` values as written
    (:class:`NestingError`); all are ``YAMLError``."""
    _check_depth(text, max_depth, max_nodes)
    return yaml.load(text, Loader=_StrictLoader)
