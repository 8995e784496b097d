"""Bounded handling of values that came from elsewhere (configs, checkpoint metadata, commits).

Nothing here expands a value to describe it: :func:`summary` says what a value is (its type, its size
and its first characters) in a bounded number of steps, even for a string of gigabytes or a YAML
alias bomb whose shared lists would expand to billions of items. :func:`measure_tree` walks a parsed
tree once per distinct container (shared ones are counted with their multiplicity but walked once)
and stops at the first limit it crosses, so a value's expanded size, nesting depth and longest string
are known before any code expands it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TreeLimits", "measure_tree", "summary"]

_PREVIEW = 60


def _preview(value: Any, budget: int, depth: int = 0) -> str:
    """At most about ``budget`` characters of ``repr(value)``, computed without expanding the rest."""
    if budget <= 0:
        return "..."
    if isinstance(value, str | bytes):
        cut = value[: budget + 1]
        text = repr(cut)
        return text if len(cut) <= budget and len(text) <= budget + 2 else text[:budget] + "..."
    if isinstance(value, dict | list | tuple | set | frozenset):
        if depth > 8:
            return "..."
        items: Any
        if isinstance(value, dict):
            open_, close, items = "{", "}", value.items()
        else:
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
            items = value if not isinstance(value, set | frozenset) else sorted(value, key=repr)
        out = open_
        for i, item in enumerate(items):
            if i:
                out += ", "
            left = budget - len(out)
            if left <= 0:
                return out + "..."
            if isinstance(value, dict):
                k, v = item
                out += _preview(k, left, depth + 1) + ": "
                out += _preview(v, budget - len(out), depth + 1)
            else:
                out += _preview(item, left, depth + 1)
            if out.endswith("..."):
                return out
        return out + close
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * budget:
        return f"<int of {value.bit_length()} bits>"
    text = repr(value) if isinstance(value, int | float | bool | type(None)) else f"<{type(value).__name__}>"
    return text if len(text) <= budget else text[:budget] + "..."


def summary(value: Any, limit: int = _PREVIEW) -> str:
    """``value`` for an error message: its type and size and its first ``limit`` or so characters.

    Bounded work and a bounded result whatever ``value`` is: short scalars are given whole
    (``'adamw'``, ``3``), anything longer as e.g. ``a str of 55,000,000 characters: 'aaaa...'`` or
    ``a list of 9 items: [['x', 'x', ...``.
    """
    text = _preview(value, limit)
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value):,} characters: {text}"
    if isinstance(value, dict | list | tuple | set | frozenset) and len(text) > 20:
        noun = "entries" if isinstance(value, dict) else "items"
        return f"a {type(value).__name__} of {len(value):,} {noun}: {text}"
    return text


@dataclass(frozen=True)
class TreeLimits:
    """What a parsed tree (dicts, lists and scalars) may hold."""

    #: containers inside containers (a flat mapping is 1)
    depth: int = 32
    #: every container and scalar, counted as often as it appears (shared ones by their multiplicity)
    nodes: int = 100_000
    #: characters of the longest string (keys included)
    string: int = 4096


def measure_tree(tree: Any, limits: TreeLimits) -> str | None:
    """``None`` when ``tree`` is within ``limits``, else the first limit crossed, as a phrase naming
    where (``'nested deeper than 32 levels at a.b.c...'``). Each distinct container is walked once, so
    the work is bounded by the tree as stored, not as expanded; a container inside itself is refused."""
    sizes: dict[int, int] = {}  # id -> nodes below and including it, for containers already walked
    on_path: set[int] = set()
    # frames: (container, its children iterator, the path to it, nodes counted so far below it)
    stack: list[tuple[Any, Any, str, list[int]]] = []

    def children(node: Any) -> Any:
        if isinstance(node, dict):
            for k, v in node.items():
                yield k, None
                yield v, k
        else:
            for i, v in enumerate(node):
                yield v, i

    def enter(node: Any, path: str) -> str | None:
        if len(stack) >= limits.depth:
            return f"nested deeper than {limits.depth} levels at {path or 'the top'}"
        on_path.add(id(node))
        stack.append((node, children(node), path, [1]))
        return None

    def check_scalar(node: Any, path: str) -> str | None:
        if isinstance(node, str | bytes) and len(node) > limits.string:
            return (
                f"a string of {len(node):,} characters at {path or 'the top'} (at most "
                f"{limits.string:,} are read)"
            )
        return None

    if not isinstance(tree, dict | list | tuple):
        return check_scalar(tree, "")
    problem = enter(tree, "")
    total = 0
    while stack and problem is None:
        node, it, path, count = stack[-1]
        step = next(it, None)
        if step is None:
            stack.pop()
            on_path.discard(id(node))
            sizes[id(node)] = count[0]
            if stack:
                stack[-1][3][0] += count[0]
            else:
                total = count[0]
            continue
        child, where = step
        child_path = path if where is None else f"{path}.{where}" if path else str(where)
        if isinstance(child, dict | list | tuple):
            if id(child) in on_path:
                problem = f"a value that contains itself at {child_path}"
            elif id(child) in sizes:
                count[0] += sizes[id(child)]
            else:
                problem = enter(child, child_path)
        else:
            count[0] += 1
            problem = check_scalar(child, child_path)
        if problem is None and sum(f[3][0] for f in stack) > limits.nodes:
            problem = (
                f"more than {limits.nodes:,} values once shared values (YAML aliases) are expanded "
                f"(at {child_path})"
            )
    if problem is None and total > limits.nodes:
        problem = f"more than {limits.nodes:,} values once shared values (YAML aliases) are expanded"
    return problem
