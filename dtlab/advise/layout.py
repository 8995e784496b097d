"""Where a rank's parameters lie: the transformer's tensors after tensor parallelism and the flat
padded buffers the data-parallel strategies build from them (pipeline stages: ``pipeline.py``).

The arithmetic mirrors the strategies exactly (``dtlab/models/dp/flat.py``, ``ddp.py``, ``zero3.py``,
``fsdp.py``): a flat unit of ``n`` elements over ``P`` ranks keeps ``c = max(1, ceil(n / P))``
elements per rank and is padded to ``c * P``; DDP/ZeRO-1/2 buckets take the trainable parameters in
reverse registration order and start a new bucket when the next one would pass ``bucket_cap_mb`` MiB;
ZeRO-3 makes one unit per parameter; FSDP one unit per block plus the root's (embeddings, final
norm, head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtlab.advise.spec import ModelSpec

__all__ = [
    "Flat",
    "Tensor",
    "buckets",
    "flat",
    "fsdp_units",
    "module_groups",
    "transformer_tensors",
    "zero3_units",
]


@dataclass(frozen=True)
class Tensor:
    """One parameter as this rank holds it: its name, its local element count, the module that owns
    it (ZeRO-3 gathers per module), the FSDP unit it belongs to and its layer (-1: embeddings,
    ``L``: final norm and head)."""

    name: str
    numel: int
    module: str
    unit: str
    layer: int


@dataclass(frozen=True)
class Flat:
    """A flat unit over ``ranks``: ``numel`` elements, ``shard`` per rank, ``padded = shard * ranks``."""

    key: str
    numel: int
    shard: int
    padded: int
    persistent: bool = False
    #: the element counts of the parameters laid out in it, in flat order (empty: one parameter)
    members: tuple[int, ...] = ()


def flat(key: str, numel: int, ranks: int, persistent: bool = False, members: Sequence[int] = ()) -> Flat:
    shard = max(1, -(-numel // ranks))
    return Flat(key, numel, shard, shard * ranks, persistent, tuple(members))


def transformer_tensors(spec: ModelSpec, tp: int = 1, pipelined: bool = False) -> list[Tensor]:
    """The parameters of ``TransformerLM`` in registration order, each as one tensor-parallel rank
    holds it under ``transformer_plan()``: vocabulary-split embedding and head, attention split by
    heads (qkv column-parallel, output projection row-parallel), MLP column- then row-parallel;
    norms, the position embedding and row-parallel biases whole. A tied head is the embedding
    itself, except under a pipeline (``pipelined``), where the last stage holds a copy."""
    h, v, s, f = spec.hidden, spec.vocab, spec.seq_len, 4 * spec.hidden
    out = [
        Tensor("tok.weight", v // tp * h, "tok", "<root>", -1),
        Tensor("pos.weight", s * h, "pos", "<root>", -1),
    ]
    for i in range(spec.layers):
        b, u = f"blocks.{i}", f"blocks.{i}"
        out += [
            Tensor(f"{b}.ln1.weight", h, f"{b}.ln1", u, i),
            Tensor(f"{b}.ln1.bias", h, f"{b}.ln1", u, i),
            Tensor(f"{b}.attn.qkv.weight", 3 * h // tp * h, f"{b}.attn.qkv", u, i),
            Tensor(f"{b}.attn.qkv.bias", 3 * h // tp, f"{b}.attn.qkv", u, i),
            Tensor(f"{b}.attn.proj.weight", h * (h // tp), f"{b}.attn.proj", u, i),
            Tensor(f"{b}.attn.proj.bias", h, f"{b}.attn.proj", u, i),
            Tensor(f"{b}.ln2.weight", h, f"{b}.ln2", u, i),
            Tensor(f"{b}.ln2.bias", h, f"{b}.ln2", u, i),
            Tensor(f"{b}.mlp.0.weight", f // tp * h, f"{b}.mlp.0", u, i),
            Tensor(f"{b}.mlp.0.bias", f // tp, f"{b}.mlp.0", u, i),
            Tensor(f"{b}.mlp.2.weight", h * (f // tp), f"{b}.mlp.2", u, i),
            Tensor(f"{b}.mlp.2.bias", h, f"{b}.mlp.2", u, i),
        ]
    out += [
        Tensor("ln_f.weight", h, "ln_f", "<root>", spec.layers),
        Tensor("ln_f.bias", h, "ln_f", "<root>", spec.layers),
    ]
    if pipelined or not spec.tied_embeddings:
        out.append(Tensor("head.weight", v // tp * h, "head", "<root>", spec.layers))
    return out


def buckets(tensors: Sequence[Tensor], ranks: int, bucket_cap_mb: float, dtype_bytes: int) -> list[Flat]:
    """DDP's (and ZeRO-1/2's) gradient buckets: reverse registration order, a new bucket when the
    next parameter would pass ``int(bucket_cap_mb * 2**20)`` bytes."""
    cap = int(bucket_cap_mb * 1024 * 1024)
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for t in reversed(tensors):
        nbytes = t.numel * dtype_bytes
        if current and size + nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(t.numel)
        size += nbytes
    groups.append(current)
    return [flat(f"bucket{i}", sum(g), ranks, members=g) for i, g in enumerate(groups)]


def zero3_units(tensors: Sequence[Tensor], ranks: int, persistence_threshold: int) -> list[Flat]:
    """ZeRO-3: one unit per parameter; at most ``persistence_threshold`` elements stay gathered."""
    return [flat(t.name, t.numel, ranks, t.numel <= persistence_threshold) for t in tensors]


def fsdp_units(tensors: Sequence[Tensor], ranks: int) -> list[Flat]:
    """FSDP with the block as the wrapped class: the root unit first, then one unit per block."""
    order: dict[str, list[int]] = {"<root>": []}
    for t in tensors:
        order.setdefault(t.unit, []).append(t.numel)
    return [flat(k, sum(g), ranks, members=g) for k, g in order.items() if sum(g)]


def module_groups(tensors: Sequence[Tensor], units: Sequence[Flat]) -> list[int]:
    """ZeRO-3: padded elements gathered per module, in forward order (modules in registration order)."""
    padded = {u.key: u.padded for u in units if not u.persistent}
    groups: dict[str, int] = {}
    for t in tensors:
        groups[t.module] = groups.get(t.module, 0) + padded.get(t.name, 0)
    return list(groups.values())
