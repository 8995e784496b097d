"""What every section of the config shares: :class:`Section` (frozen, no unknown keys, no infinities, no
``true`` for a number) and the field checks more than one section uses."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def one_of(value: Any, allowed: tuple[str, ...]) -> Any:
    """A choice from a table that grows (the pairing table) rather than a fixed ``Literal``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Input should be one of {', '.join(repr(a) for a in allowed)}")
    return value


class Section(BaseModel):
    # allow_inf_nan=False: no setting is meaningful at infinity or NaN (an infinite lr or timeout)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """Strict numbers: pydantic would take ``true`` for 1 (``--set train.steps=true``)."""
        if isinstance(v, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            types = set(get_args(annotation)) or {annotation}
            if types & {int, float} and bool not in types:
                kind = "an integer" if int in types else "a number"
                raise ValueError(f"a bool is not a number here; give {kind}")
        return v


def check_reference(value: str | None, field: str) -> str | None:
    """``pkg.mod:fn`` (the shape only; importing it is checked before any rank starts)."""
    if value is None:
        return None
    mod, sep, fn = value.partition(":")
    if not sep or not mod or not fn or not all(p.isidentifier() for p in [*mod.split("."), *fn.split(".")]):
        raise ValueError(f"{field} must look like package.module:function, got {value!r}")
    return value
