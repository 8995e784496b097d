"""Tensor-parallel layers (Megatron-LM's): column- and row-parallel linear layers and a vocabulary-
parallel embedding, each holding only this rank's shard (communication: :mod:`dtlab.models.tensor._comm`).

Each layer is built from the plain layer it replaces (``from_linear`` / ``from_embedding``), keeps its
parameter names (``weight``, ``bias``) so ``state_dict()`` keys do not change, and records every
parameter's placement (:mod:`dtlab.core.placement`). They subclass ``nn.Linear`` / ``nn.Embedding``
(torch's DTensor tensor parallelism keeps the module's type), so code walking modules by type finds them.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Placement, Replicate, Shard, placement_of, set_placement
from dtlab.errors import StrategyError, check_switches
from dtlab.models.tensor._comm import (
    SharedInput,
    check_divisible,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_seq,
    scatter_to_tp,
    tp_size,
)
from dtlab.models.tensor._sources import (
    built_like,
    check_forward,
    check_row_input,
    check_shard,
    embedding_scale,
)
from dtlab.models.tensor._split_logits import unmarked

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

AXIS = "tp"
META = torch.device("meta")


def _parameter(
    shape: tuple[int, ...], placement: Placement, device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Parameter:
    """An uninitialized parameter of this rank's ``shape``, placed."""
    t = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    set_placement(t, placement)
    return t


def _reset_linear(layer: ColumnParallelLinear | RowParallelLinear) -> None:
    """``nn.Linear``'s initialization (uniform in ``1/sqrt(fan_in)``) with the whole layer's fan-in;
    each rank draws its own pieces (not one process's values: initialize before wrapping for those)."""
    bound = 1.0 / math.sqrt(layer.in_features) if layer.in_features > 0 else 0.0
    for p in (layer.weight, layer.bias):
        if p is not None:
            nn.init.uniform_(p, -bound, bound)


_Layer = TypeVar("_Layer", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")
_Linear = TypeVar("_Linear", "ColumnParallelLinear", "RowParallelLinear")


def check_parameters(source: nn.Module, where: str) -> None:
    """Refuse a layer already split over tp, or a ``weight``/``bias`` that is not an ``nn.Parameter``."""
    if isinstance(source, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
        raise StrategyError(
            f"{where}: it is already split over tp ({type(source).__name__}); wrap the plain module once"
        )
    check_forward(source, where)
    buffers = {n for n, _ in source.named_buffers(recurse=False)}
    for attr in ("weight", "bias"):
        value = getattr(source, attr, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            kind = "a buffer" if attr in buffers else "a plain tensor attribute"
            fix = "make it an nn.Parameter (requires_grad=False keeps it frozen)"
            if nn.utils.parametrize.is_parametrized(source, attr):  # weight_norm, spectral_norm, ...
                kind, fix = "a parametrization's output", "remove_parametrizations() before wrapping"
            raise StrategyError(
                f"{where}: its {attr!r} is {kind} ({type(source).__name__}), not an nn.Parameter, so it "
                f"cannot be split over tp; {fix} or leave this module out of the tensor-parallel plan"
            )


def _load(layer: _Layer, source: nn.Module, group: CommunicationBackend) -> _Layer:
    """``layer``, built on the meta device, holding this rank's part of each of ``source``'s parameters
    (named alike: ``weight``, ``bias``) as its placement says, on the device of ``source``'s weight,
    with their ``requires_grad`` flags.

    Built on the meta device, the layer's constructor draws nothing from torch's global RNG (in-memory
    ranks are threads sharing it, and the user's own draws on other ranks are theirs) and initializes
    nothing it would overwrite."""
    check_parameters(source, f"{type(layer).__name__}: the {type(source).__name__} it replaces")
    device = source.get_parameter("weight").device
    with torch.no_grad():
        for name, empty in list(layer.named_parameters(recurse=False)):
            whole = source.get_parameter(name)
            placement = placement_of(empty)
            param = nn.Parameter(torch.empty_like(empty, device=device), requires_grad=whole.requires_grad)
            if isinstance(placement, Shard):
                param.copy_(placement.local_shard(whole.detach(), group.rank, group.world_size))
            else:
                param.copy_(whole.detach())
            set_placement(param, placement)
            layer.register_parameter(name, param)
    return layer


def _from_linear(
    cls: type[_Linear], linear: nn.Module, group: CommunicationBackend, **options: Any
) -> _Linear:
    """``cls`` built with ``options`` holding this rank's shard of ``linear`` (see :func:`built_like`)."""
    return _load(built_like(cls, linear, group, **options), linear, group)


class ColumnParallelLinear(nn.Linear):
    """``y = x A^T + b`` with the output features split over tp: this rank holds ``out/tp`` rows of A.
    An ``nn.Linear`` whose ``in_features`` / ``out_features`` are the whole layer's and whose ``weight``
    and ``bias`` are this rank's pieces (``transposed``: laid out ``[in, out]`` as the ``Conv1D`` it
    replaces); ``reset_parameters()`` draws them as ``nn.Linear`` does, with the whole fan-in.

    Args:
        in_features, out_features: the full layer's sizes (``out_features`` divisible by tp x sections).
        group: the tensor-parallel group.
        bias: whether the layer has a bias (split like the output features).
        gather_output: all-gather the output features (a whole ``y`` on every rank); ``False`` leaves
            ``y`` split along its last dim for a following row-parallel layer.
        sequence_parallel: the input is this rank's chunk of the sequence (dim -2): all-gather it
            first (backward: reduce-scatter) instead of the identity/all-reduce pair.
        sections: the output features are that many fused, equal sections (a qkv projection: 3),
            each split over tp, so rank r holds part r of every section.
        transposed: the weight is laid out ``[in, out]`` (Hugging Face's ``Conv1D``), split along dim 1.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: CommunicationBackend,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sections: int = 1,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would build the whole weight
        p = tp_size(group, "ColumnParallelLinear", in_features=in_features, out_features=out_features)
        check_switches(
            "ColumnParallelLinear",
            bias=bias,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            transposed=transposed,
        )
        check_divisible(
            out_features,
            p * sections,
            f"ColumnParallelLinear: out_features ({sections} section(s) x tp)",
            f"choose a tp that divides {out_features // max(sections, 1)}",
        )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.sections, self.transposed = sections, transposed
        #: shared with the model's other column-parallel layers (one input gradient all-reduce per input)
        self.shared_input: SharedInput | None = None
        self.mark_output: Any = unmarked  #: the model's head left split: the composition marks its output
        o = out_features // p
        self.local_shape = (in_features, o) if transposed else (o, in_features)
        self.weight = _parameter(self.local_shape, Shard(AXIS, int(transposed), sections), device, dtype)
        b = _parameter((o,), Shard(AXIS, 0, sections), device, dtype) if bias else None
        self.register_parameter("bias", b)
        self.reset_parameters()

    reset_parameters = _reset_linear

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        group: CommunicationBackend,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sections: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (an ``nn.Linear`` or a ``Conv1D``: its values, bias, layout,
        device, dtype and ``requires_grad`` flags); the options as the constructor's."""
        return _from_linear(
            cls,
            linear,
            group,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            sections=sections,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shard(self, self.weight, self.local_shape)
        fn = gather_from_sequence if self.sequence_parallel else copy_to_tp
        x = fn(x, self.group) if self.shared_input is None else self.shared_input(x, self.group, fn)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else self.mark_output(y)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local "
            f"{self.out_features // self.group.world_size}), tp={self.group.world_size}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Linear):
    """``y = x A^T + b`` with the input features split over tp: this rank holds ``in/tp`` columns of A.
    An ``nn.Linear`` as :class:`ColumnParallelLinear` is (whole sizes, this rank's ``weight``).

    Args:
        in_features, out_features: the full layer's sizes (``in_features`` divisible by tp).
        group: the tensor-parallel group.
        bias: whether the layer has a bias (replicated; added after the reduction).
        input_is_parallel: the input already arrives split along its last dim (from a
            column-parallel layer); ``False`` splits a whole input first.
        sequence_parallel: reduce-scatter the output along the sequence (dim -2) instead of
            all-reducing it; the bias gradient is then a partial sum that the model all-reduces.
        transposed: the weight is laid out ``[in, out]`` (Hugging Face's ``Conv1D``), split along dim 0.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: CommunicationBackend,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would build the whole weight
        p = tp_size(group, "RowParallelLinear", in_features=in_features, out_features=out_features)
        check_switches(
            "RowParallelLinear",
            bias=bias,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            transposed=transposed,
        )
        check_divisible(in_features, p, "RowParallelLinear: in_features")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.transposed = group, transposed
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        i = in_features // p
        self.local_shape = (i, out_features) if transposed else (out_features, i)
        self.weight = _parameter(self.local_shape, Shard(AXIS, int(not transposed)), device, dtype)
        self.register_parameter(
            "bias", _parameter((out_features,), Replicate(), device, dtype) if bias else None
        )
        self.reset_parameters()

    reset_parameters = _reset_linear

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        group: CommunicationBackend,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """This rank's shard of ``linear`` (as :meth:`ColumnParallelLinear.from_linear`; the bias whole:
        it is added once, after the reduction); the options as the constructor's."""
        return _from_linear(
            cls, linear, group, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_shard(self, self.weight, self.local_shape)
        if self.input_is_parallel:
            check_row_input(self, x, self.local_shape[0 if self.transposed else 1])
        else:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        y = reduce_scatter_to_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_features // self.group.world_size}), "
            f"out_features={self.out_features}, tp={self.group.world_size}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Embedding):
    """An embedding table split by rows (the vocabulary) over tp: rank r holds ids ``[r*V/tp, (r+1)*V/tp)``.

    Each rank looks up the ids it holds (zeros for the others) and the partial rows are summed over tp
    (all-reduce), or reduce-scattered along the sequence with ``sequence_parallel``. An ``nn.Embedding``:
    ``num_embeddings`` is the whole vocabulary, ``weight`` this rank's rows and ``padding_idx`` (given as
    an id of the vocabulary) the padding row in ``weight`` where this rank holds it, else ``None``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: CommunicationBackend,
        *,
        sequence_parallel: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would build the whole table
        p = tp_size(group, "VocabParallelEmbedding", num_embeddings=num_embeddings)
        check_switches("VocabParallelEmbedding", sequence_parallel=sequence_parallel)
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise StrategyError(
                f"VocabParallelEmbedding: padding_idx={padding_idx} is not an id of the vocabulary "
                f"[0, {num_embeddings})"
            )
        check_divisible(
            num_embeddings,
            p,
            "VocabParallelEmbedding: the vocabulary (num_embeddings)",
            f"pad the vocabulary to a multiple of {p} or choose a tp that divides {num_embeddings}",
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.group, self.sequence_parallel = group, sequence_parallel
        self.per_rank = num_embeddings // p
        self.vocab_start = group.rank * self.per_rank
        local_pad = -1 if padding_idx is None else padding_idx - self.vocab_start
        self.padding_idx = local_pad if 0 <= local_pad < self.per_rank else None  # its gradient: 0
        self.weight = _parameter((self.per_rank, embedding_dim), Shard(AXIS, 0), device, dtype)
        self.register_buffer("embed_scale", None, persistent=False)  # a scaled embedding's: from_embedding
        self.scale, self.scale_cast = cast(float | None, None), False  # its float scale, its cast
        self.reset_parameters()  # nn.Embedding's: normal, the padding row zero

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, group: CommunicationBackend, *, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``emb`` (its values, padding id, device, dtype and ``requires_grad``)."""
        options = {k: getattr(emb, k) for k in ("max_norm", "scale_grad_by_freq", "sparse")}
        bad = {k: v for k, v in options.items() if v is not None and v is not False}
        if bad:
            raise StrategyError(
                f"VocabParallelEmbedding does not support nn.Embedding options {bad}; build the embedding "
                "without them to split it over tp"
            )
        new = cls(
            emb.num_embeddings,
            emb.embedding_dim,
            group,
            sequence_parallel=sequence_parallel,
            padding_idx=emb.padding_idx,
            device=META,  # built empty, then filled by _load on the source's device
            dtype=emb.weight.dtype,
        )
        if scaled := embedding_scale(emb):  # Hugging Face's scaled embedding: its buffer itself or float
            new.register_buffer("embed_scale", scaled[0], persistent=False)
            new.scale, new.scale_cast = scaled[1:]
        return _load(new, emb, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_shard(self, self.weight, (self.per_rank, self.embedding_dim))
        pad = self.padding_idx
        if self.group.world_size == 1:
            return self._scaled(F.embedding(ids, self.weight, pad))
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        reduce = reduce_scatter_to_seq if self.sequence_parallel else reduce_from_tp
        return self._scaled(reduce(out, self.group))

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:  # as the scaled embedding it replaces
        if isinstance(scale := self.embed_scale, torch.Tensor):
            return rows * (scale.to(self.weight.dtype) if self.scale_cast else scale)
        return rows if self.scale is None else rows * self.scale

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, ids [{self.vocab_start}, "
            f"{self.vocab_start + self.per_rank}) on this rank, tp={self.group.world_size}"
        )
