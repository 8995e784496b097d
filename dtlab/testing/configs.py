"""Config overrides for tests of your own: the default transformer LM shrunk to train in seconds."""

from __future__ import annotations

__all__ = ["TINY_LM"]

#: ``--set`` overrides (``load_config(overrides=[*TINY_LM, ...])``): a one-layer 32-wide byte-level
#: transformer on 40 kB of the stdlib corpus, global batch 8; later overrides win
TINY_LM: tuple[str, ...] = (
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.seq_len=32",
    "data.max_bytes=40000",
    "data.global_batch_size=8",
)
