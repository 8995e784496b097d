"""Every setting of ``dtlab train`` described from the config models themselves, so the help cannot
drift from the code: the name (``section.field``), the default, the allowed values (from the type and
the ``Field`` bounds) and the ``#:`` comment above the field in :mod:`dtlab.config_sections`.

``dtlab train --help`` lists them with a one-line description (the comment's first clause);
``dtlab config --describe`` prints the whole comment and the allowed values.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["Setting", "allowed_text", "comments", "describe", "help_epilog", "settings"]

_FIELD = re.compile(r"^    (\w+)\s*:")
_PAD = 42  # where descriptions start in ``dtlab train --help``


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    allowed: str
    description: str

    @property
    def short(self) -> str:
        """The description's first clause: up to the first ``;`` or sentence end outside brackets."""
        text, depth = self.description, 0
        for i, ch in enumerate(text):
            depth += ch in "(["
            depth -= ch in ")]"
            sentence = text.startswith(". ", i) and not text[:i].endswith(("e.g", "i.e", "."))
            if depth == 0 and (text.startswith("; ", i) or sentence):
                return text[:i]
        return text.rstrip(".")


def comments(cls: type) -> dict[str, str]:
    """``{field: text}`` of the ``#:`` comment lines right above each field of ``cls``'s body."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source (a frozen install): the names and types still show
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = _FIELD.match(line)
        if m and pending:
            out[m.group(1)] = " ".join(pending).replace("``", "`")
        pending = []
    return out


def _type_text(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_text(a) for a in get_args(annotation))
    if origin in (list, tuple, dict):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def allowed_text(info: FieldInfo) -> str:
    """The type (or its choices) and any bounds: ``int >= 1``, ``"fp32" | "bf16" | "fp16"``."""
    text = _type_text(info.annotation)
    bounds = []
    for meta in info.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                bounds.append(f"{op} {value}")
    return f"{text} {', '.join(bounds)}".strip()


def _choices(name: str) -> str | None:
    """Choices a validator takes from a table rather than the type (the pairing table)."""
    from dtlab.config import MODEL_STRATEGIES, OPTIMIZER_STRATEGIES

    table = {"strategy.model": MODEL_STRATEGIES, "strategy.optimizer": OPTIMIZER_STRATEGIES}.get(name)
    if table is None:
        return None
    return " | ".join(json.dumps(c) for c in table) + (" | null" if name == "strategy.optimizer" else "")


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def settings(model: type[BaseModel] | None = None, prefix: str = "") -> list[Setting]:
    """Every leaf setting of ``model`` (default: ``TrainConfig``), in declaration order."""
    if model is None:
        from dtlab.config import TrainConfig

        model = TrainConfig
    notes = comments(model)
    out: list[Setting] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += settings(ann, f"{prefix}{name}.")
            continue
        default = _default(info)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        allowed = _choices(f"{prefix}{name}") or allowed_text(info)
        out.append(Setting(f"{prefix}{name}", default, allowed, notes.get(name, "")))
    return out


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return str(v)


def help_epilog(width: int = 110) -> str:
    """The settings section of ``dtlab train --help``: ``name=default  description`` per line."""
    rows = settings()
    lines = [
        "settings (--set KEY=VALUE, repeatable; or a YAML/TOML file with -c; "
        "allowed values: dtlab config --describe):"
    ]
    section = ""
    for s in rows:
        head = s.name.split(".")[0]
        if head != section:
            section = head
            lines.append(f"  {section}:")
        left = f"    {s.name}={_value(s.default)}"
        if len(left) + 2 > _PAD:
            lines.append(left)
            left = ""
        wrapped = textwrap.wrap(s.short, max(30, width - _PAD)) or [""]
        lines.append(f"{left.ljust(_PAD)}{wrapped[0]}".rstrip())
        lines += [" " * _PAD + more for more in wrapped[1:]]
    return "\n".join(lines)


def describe(current: dict[str, Any] | None = None) -> str:
    """``dtlab config --describe``: per setting its value (``current``, else the default), the
    allowed values and the whole description."""
    lines = []
    section = ""
    for s in settings():
        head = s.name.split(".")[0]
        if head != section:
            section = head
            lines.append(f"{section}:")
        value = s.default
        if current is not None:
            node: Any = current
            for part in s.name.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            value = node
        default = "" if current is None or value == s.default else f" (default {_value(s.default)})"
        lines.append(f"  {s.name} = {_value(value)}{default}")
        lines.append(f"      allowed: {s.allowed}")
        if s.description:
            lines.append(f"      {s.description}")
    return "\n".join(lines)
