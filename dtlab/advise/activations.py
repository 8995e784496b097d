"""Activation memory: the bytes autograd keeps from the forward for the backward.

Counted tensor by tensor for dtlab's ``TransformerLM`` (fused-attention kernels keep no ``s x s``
matrix, only one log-sum-exp per head and position), per micro-batch of ``n`` tokens; the batch
itself (token ids, targets) is not counted:

- a block keeps ``4 h + 4`` values per token whatever ``tp`` is (the two LayerNorms' inputs and
  outputs, their mean and 1/std) and ``(12 h + a) / tp`` split ones (q, k, v, the attention output,
  one log-sum-exp per head, the MLP's ``4 h`` pre- and post-GELU values);
- with activation checkpointing a block keeps only its input (``h`` per token) and one block at a
  time is recomputed during the backward;
- the first stage keeps the positions (8 bytes each), under tensor parallelism also the local token
  ids and a mask (9 bytes per token);
- the last stage keeps the final LayerNorm's input, output and statistics (``2 h + 2``) and the
  log-probabilities (``V / tp`` per token), then 4 bytes (the loss's total weight), or under tensor
  parallelism the local target ids, two masks and a count (10 bytes per token and 8).
"""

from __future__ import annotations

from dtlab.advise.spec import ModelSpec

__all__ = ["activation_bytes", "block_bytes_per_token"]


def block_bytes_per_token(spec: ModelSpec, tp: int) -> int:
    h, a, e = spec.hidden, spec.heads, spec.dtype_bytes
    return (4 * h + 4 + 12 * h // tp + a // tp) * e


def activation_bytes(
    spec: ModelSpec,
    sequences: int,
    blocks: int,
    *,
    first: bool = True,
    last: bool = True,
    tp: int = 1,
    checkpointing: bool = False,
) -> int:
    """Bytes kept for one forward of ``sequences`` sequences through ``blocks`` blocks of a stage."""
    e, h, s = spec.dtype_bytes, spec.hidden, spec.seq_len
    n = sequences * s
    per_block = block_bytes_per_token(spec, tp) * n
    if checkpointing:
        total = blocks * n * h * e + (per_block if blocks else 0)
    else:
        total = blocks * per_block
    if first:
        total += 8 * s + (9 * n if tp > 1 else 0)
    if last:
        total += n * (2 * h + 2) * e + n * (spec.vocab // tp) * e
        total += 10 * n + 8 if tp > 1 else 4
    return total
