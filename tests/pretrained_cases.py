"""``load_pretrained`` in the tests: what a rank reads back after loading, and the check that it is the
saved state, bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dtlab.checkpoint import load_pretrained


def load_into(model: Any, source: Path) -> dict[str, Any]:
    """``load_pretrained(model, source)``; its report (missing, unexpected, mismatched) and the model's
    whole state after it (collective)."""
    report = load_pretrained(model, source)
    return {
        "report": (report.missing, report.unexpected, report.mismatched),
        "loaded": model.full_state_dict(),
    }


def assert_loaded_bitwise(got: dict[str, Any], saved: dict[str, torch.Tensor], where: str) -> None:
    """What :func:`load_into` returned: nothing missing, unexpected or mismatched, every saved tensor."""
    assert got["report"] == ([], [], []), where
    loaded = got["loaded"]
    assert sorted(loaded) == sorted(saved), where
    assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == [], where
