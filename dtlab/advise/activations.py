"""Activation memory: the bytes autograd keeps from the forward for the backward.

Counted tensor by tensor for dtlab's ``TransformerLM`` (fused-attention kernels keep no ``s x s``
matrix, only one log-sum-exp per head and position), per micro-batch of ``n`` tokens, each value
``e`` bytes wide (the precision's activation width); the batch itself (token ids, targets) is not
counted:

- a block keeps ``4 h + 4`` values per token whatever ``tp`` is (the two LayerNorms' inputs and
  outputs, their mean and 1/std) and ``(12 h + a) / tp`` split ones (q, k, v, the attention output,
  one log-sum-exp per head, the MLP's ``4 h`` pre- and post-GELU values); without fused attention
  (``ModelSpec.fused_attention=False``) the softmax of every local head instead of its log-sum-exp:
  ``(12 h + a s) / tp``;
- the first stage keeps the positions (8 bytes each), under tensor parallelism also the local token
  ids and a mask (9 bytes per token);
- the last stage keeps the final LayerNorm's input, output and statistics (``2 h + 2``) and, in the
  loss, the log-probabilities (``V / tp`` per token), then 12 bytes (the loss's total weight, and
  the count of targets that are not -100 its sum is divided by), or
  with the vocabulary-parallel cross entropy (dtlab train's loss where the logits stay split over
  tp > 1) the local target ids, two masks and a count (10 bytes per token and 8).

Activation checkpointing splits this into what each micro-batch keeps until its backward and a
working set rebuilt once at a time during the backward (:class:`Held`): per block, a block keeps
only its input (``h`` per token) and one block's activations are rebuilt at a time; per pipeline
stage, the stage keeps its input and output (and the loss's share, computed outside the
checkpoint) and the whole stage is rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.advise.spec import ModelSpec

__all__ = ["Held", "block_bytes_per_token", "stage_activations"]


@dataclass(frozen=True)
class Held:
    """One micro-batch on one stage: ``kept`` from its forward to its backward (what dtlab's meters
    count), ``rebuilt``: the working set a checkpointed backward recomputes (one at a time per rank)."""

    kept: int
    rebuilt: int = 0


def block_bytes_per_token(spec: ModelSpec, tp: int, e: int) -> int:
    h, a = spec.hidden, spec.heads
    scores = a // tp if spec.fused_attention else a // tp * spec.seq_len
    return (4 * h + 4 + 12 * h // tp + scores) * e


def _loss_bytes(spec: ModelSpec, n: int, tp: int, e: int, parallel: bool) -> int:
    """What the loss keeps: log-probabilities, the total weight and the int64 count of the targets
    that are not -100 (dtlab's cross entropy divides its sum by it); the vocabulary-parallel cross
    entropy (``parallel``: what dtlab train uses where the logits are split over tp > 1) local target
    ids, two masks and a count instead."""
    return n * (spec.vocab // tp) * e + (10 * n + 8 if parallel else 4 + 8)


def stage_activations(
    spec: ModelSpec,
    sequences: int,
    blocks: int,
    e: int,
    *,
    first: bool = True,
    last: bool = True,
    tp: int = 1,
    checkpointing: str = "none",
    pipelined: bool = False,
) -> Held:
    """One forward of ``sequences`` sequences through a stage of ``blocks`` blocks (the whole model
    when ``first`` and ``last``). ``pipelined``: the stage also holds its output (``n h`` values; the
    last stage its 4-byte loss) and, under stage checkpointing, its input."""
    h, s = spec.hidden, spec.seq_len
    n = sequences * s
    per_block = block_bytes_per_token(spec, tp, e) * n
    head = n * (2 * h + 2) * e if last else 0
    loss = _loss_bytes(spec, n, tp, e, tp > 1) if last else 0
    embed = 8 * s + (9 * n if tp > 1 else 0) if first else 0
    output = (4 if last else n * h * e) if pipelined else 0
    if checkpointing == "stage":
        kept = (0 if first else n * h * e) + output + loss
        return Held(kept, blocks * per_block + embed + head)
    if checkpointing == "block":
        kept = blocks * n * h * e + embed + head + loss + output
        return Held(kept, per_block if blocks else 0)
    return Held(blocks * per_block + embed + head + loss + output)
