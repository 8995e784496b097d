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
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dtlab.advise.spec import ModelSpec
from dtlab.backends.inmemory import InMemoryWorld
from dtlab.errors import ArgumentError
from dtlab.models import apply_tensor_plan, transformer_plan
from dtlab.zoo import Block, TransformerLM

__all__ = [
    "Flat",
    "Tensor",
    "buckets",
    "flat",
    "fsdp_units",
    "module_groups",
    "transformer_model",
    "layout_spec",
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


def transformer_model(spec: ModelSpec, tp: int = 1, base: TransformerLM | None = None) -> TransformerLM:
    """dtlab's ``TransformerLM`` with ``spec``'s sizes on the meta device (no memory), as tensor-parallel
    rank 0 of ``tp`` holds it: its own tensor plan (``tp_plan()``) applied by the strategies' code.
    ``base``: that model already built for ``spec`` (whole), returned for ``tp`` = 1 and never changed
    (for ``tp`` > 1 a fresh build, its initializers skipped, costs less than a copy of it)."""
    if base is None or tp > 1:
        with torch.device("meta"), _ShapesOnly():
            base = TransformerLM(
                spec.hidden,
                spec.layers,
                spec.heads,
                spec.seq_len,
                vocab=spec.vocab,
                tie_embeddings=spec.tied_embeddings,
            )
    if tp > 1:
        with _ShapesOnly():
            apply_tensor_plan(base, transformer_plan(), InMemoryWorld(tp).backend(0))  # no communication
    return base


#: initializers that only write values (``torch.nn.init``'s and the tensor methods they end in)
_INITIALIZERS = frozenset(
    {
        torch.nn.init.normal_,
        torch.nn.init.uniform_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.xavier_uniform_,
        torch.nn.init.xavier_normal_,
        torch.nn.init.zeros_,
        torch.nn.init.ones_,
        torch.nn.init.constant_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.zero_,
        torch.Tensor.fill_,
    }
)


class _ShapesOnly(TorchFunctionMode):
    """Initializers of meta tensors skipped (a meta tensor holds no values; on the meta device each
    random initializer runs torch's Python decomposition, most of a model build's time). Every shape,
    module and parameter is made as without it. Per thread, as every torch function mode."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        if func is torch.cat and args and not kwargs.keys() - {"dim"}:
            joined = _meta_cat(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0))
            if joined is not None:
                return joined
        return func(*args, **kwargs)


def _meta_cat(tensors: Any, dim: Any) -> torch.Tensor | None:
    """``torch.cat(tensors, dim)`` of meta tensors of one dtype and rank (a tensor-parallel shard's
    sections): the new contiguous meta tensor of the joined shape. torch's own meta ``cat`` runs a
    Python reference that imports ``torch._dynamo`` (about a second, once per process); ``None``
    where any other case is left to torch."""
    if not isinstance(tensors, list | tuple) or not tensors or not isinstance(dim, int):
        return None
    first = tensors[0]
    if (
        not all(
            isinstance(t, torch.Tensor)
            and t.is_meta
            and t.dtype == first.dtype
            and t.dim() == first.dim() > 0
            for t in tensors
        )
        or not -first.dim() <= dim < first.dim()
    ):
        return None
    d = dim % first.dim()
    if any(t.shape[:d] != first.shape[:d] or t.shape[d + 1 :] != first.shape[d + 1 :] for t in tensors):
        return None
    shape = [*first.shape[:d], sum(t.shape[d] for t in tensors), *first.shape[d + 1 :]]
    return torch.empty(shape, dtype=first.dtype, device="meta")


def transformer_tensors(
    spec: ModelSpec, tp: int = 1, pipelined: bool = False, base: TransformerLM | None = None
) -> list[Tensor]:
    """The parameters of ``TransformerLM`` in registration order, each as one tensor-parallel rank
    holds it under the plan the model declares, read from the model itself (built on the meta device:
    names, local sizes, owning modules, its ``Block`` instances as FSDP units and its
    ``pipeline_blocks()`` as layers, -1 for the first block and ``L`` for the last). A tied head is
    the embedding itself, except under a pipeline (``pipelined``), where the last stage holds a copy.
    The model is built with one block (:func:`layout_spec`; every block is alike), repeated for the
    rest. ``base``: ``transformer_model(layout_spec(spec))`` built once
    (a search reuses it)."""
    built = layout_spec(spec)
    module = transformer_model(built, tp, base)
    block_of = {
        id(m): i - 1 for i, (_, block) in enumerate(module.pipeline_blocks()) for m in block.modules()
    }
    units = {id(m): name for name, b in module.named_modules() if isinstance(b, Block) for m in b.modules()}
    out: list[Tensor] = []
    for name, param in module.named_parameters(remove_duplicate=not pipelined):
        owner = name.rpartition(".")[0]
        mod = module.get_submodule(owner)
        out.append(Tensor(name, param.numel(), owner, units.get(id(mod), "<root>"), block_of[id(mod)]))
    return out if built is spec else _repeat_blocks(out, built.layers, spec.layers)


def layout_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with one block: what :func:`transformer_tensors` builds (the blocks of
    ``TransformerLM`` are alike, so a second or 100th one adds nothing a build could tell)."""
    return spec if spec.layers == 1 else replace(spec, layers=1)


def _repeat_blocks(tensors: list[Tensor], built: int, layers: int) -> list[Tensor]:
    """The tensors of a ``built``-block model as those of ``layers`` blocks: the last block built
    repeated as ``blocks.{i}``, the final norm and head moved to layer ``layers``."""
    last = [t for t in tensors if t.layer == built - 1]
    stem = f"blocks.{built - 1}"
    if not last or any(not (t.name.startswith(stem + ".") and t.unit == stem) for t in last):
        raise ArgumentError(  # TransformerLM's blocks are ``blocks.<i>``; a renamed one is a bug here
            f"advise: the model's last block is not laid out as {stem}.*: {[t.name for t in last]}; "
            "transformer_tensors must build it whole"
        )
    out = [t for t in tensors if t.layer < built]
    n = len(stem)
    for i in range(built, layers):
        out += [
            Tensor(f"blocks.{i}{t.name[n:]}", t.numel, f"blocks.{i}{t.module[n:]}", f"blocks.{i}", i)
            for t in last
        ]
    return out + [replace(t, layer=layers) for t in tensors if t.layer == built]


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
