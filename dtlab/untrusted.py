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
    if not isinstance(tree, dict | list | tuple):
        return _check_scalar(tree, "", limits)
    return _TreeWalk(limits).run(tree)


def _children(node: Any) -> Any:
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, None
            yield v, k
    else:
        for i, v in enumerate(node):
            yield v, i


def _check_scalar(node: Any, path: str, limits: TreeLimits) -> str | None:
    if isinstance(node, str | bytes) and len(node) > limits.string:
        where = path or "the top"
        return f"a string of {len(node):,} characters at {where} (at most {limits.string:,} are read)"
    return None


class _TreeWalk:
    """:func:`measure_tree`'s walk, iterative (no recursion limit), each distinct container once."""

    def __init__(self, limits: TreeLimits) -> None:
        self.limits = limits
        self.sizes: dict[int, int] = {}  # id -> nodes below and including it, for containers walked
        self.on_path: set[int] = set()
        # frames: (container, its children iterator, the path to it, nodes counted so far below it)
        self.stack: list[tuple[Any, Any, str, list[int]]] = []
        self.total = 0

    def enter(self, node: Any, path: str) -> str | None:
        if len(self.stack) >= self.limits.depth:
            return f"nested deeper than {self.limits.depth} levels at {path or 'the top'}"
        self.on_path.add(id(node))
        self.stack.append((node, _children(node), path, [1]))
        return None

    def leave(self) -> None:
        node, _, _, count = self.stack.pop()
        self.on_path.discard(id(node))
        self.sizes[id(node)] = count[0]
        if self.stack:
            self.stack[-1][3][0] += count[0]
        else:
            self.total = count[0]

    def visit(self, child: Any, child_path: str, count: list[int]) -> str | None:
        """Count ``child`` below its parent (a container walked already: its whole size)."""
        if not isinstance(child, dict | list | tuple):
            count[0] += 1
            return _check_scalar(child, child_path, self.limits)
        if id(child) in self.on_path:
            return f"a value that contains itself at {child_path}"
        if id(child) in self.sizes:
            count[0] += self.sizes[id(child)]
            return None
        return self.enter(child, child_path)

    def run(self, tree: Any) -> str | None:
        nodes = self.limits.nodes
        problem = self.enter(tree, "")
        while self.stack and problem is None:
            _, it, path, count = self.stack[-1]
            step = next(it, None)
            if step is None:
                self.leave()
                continue
            child, where = step
            child_path = path if where is None else f"{path}.{where}" if path else str(where)
            problem = self.visit(child, child_path, count)
            if problem is None and sum(f[3][0] for f in self.stack) > nodes:
                problem = (
                    f"more than {nodes:,} values once shared values (YAML aliases) are expanded "
                    f"(at {child_path})"
                )
        if problem is None and self.total > nodes:
            problem = f"more than {nodes:,} values once shared values (YAML aliases) are expanded"
        return problem
