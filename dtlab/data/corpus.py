"""Real data present on every machine offline.

* ``stdlib``: the Python standard library's own source files (``os.path.dirname(os.__file__)``), the
  top-level ``*.py`` files sorted by name, read up to ``max_bytes``: a deterministic byte-level corpus.
  (It differs between Python versions, which is fine: every rank of one run reads the same files.)
* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dtlab.data.dataset import TensorDataset
from dtlab.errors import integer

__all__ = ["load_digits_dataset", "load_stdlib_corpus", "stdlib_lm_dataset"]

SEPARATOR = b"\n\n# ---- %s ----\n\n"
#: the smallest corpus: fewer bytes read from the standard library mean its source files are missing
MIN_BYTES = 1024


def stdlib_files() -> list[Path]:
    root = Path(os.path.dirname(os.__file__))
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_stdlib_corpus(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of standard-library source, whole files in name order (the last one cut)."""
    if integer(max_bytes) is None or max_bytes < MIN_BYTES:
        raise ValueError(
            f"max_bytes must be an int >= {MIN_BYTES} (bytes of source to read), got {max_bytes!r}"
        )
    max_bytes = int(max_bytes)
    parts: list[bytes] = []
    total = 0
    for path in stdlib_files():
        chunk = SEPARATOR % path.name.encode() + path.read_bytes()
        parts.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    data = b"".join(parts)[:max_bytes]
    if len(data) < MIN_BYTES:
        raise FileNotFoundError(
            f"found only {len(data)} bytes of Python source under {os.path.dirname(os.__file__)}; "
            "the stdlib corpus needs the standard library's .py files"
        )
    return data


def stdlib_lm_dataset(max_bytes: int, seq_len: int) -> TensorDataset:
    """Non-overlapping windows: input = ``seq_len`` bytes, target = the same shifted by one byte."""
    if integer(seq_len) is None or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1 (bytes per window), got {seq_len!r}")
    seq_len = int(seq_len)
    data = torch.frombuffer(bytearray(load_stdlib_corpus(max_bytes)), dtype=torch.uint8).long()
    n = (data.numel() - 1) // seq_len
    if n < 2:
        raise ValueError(f"corpus of {data.numel()} bytes gives fewer than 2 windows of seq_len={seq_len}")
    inputs = data[: n * seq_len].view(n, seq_len)
    targets = data[1 : n * seq_len + 1].view(n, seq_len)
    return TensorDataset(inputs.clone(), targets.clone())


def load_digits_dataset() -> TensorDataset:
    """scikit-learn's digits as ``(N, 1, 8, 8)`` floats in [0, 1] and integer labels."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("the digits dataset needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    # a fixed shuffle so the held-out tail has every class
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x[perm].contiguous(), y[perm].contiguous())
