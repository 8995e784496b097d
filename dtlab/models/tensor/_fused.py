"""Hugging Face's fused projections, which a plain column split gets silently wrong.

Some Hugging Face models compute several projections with one ``nn.Linear`` and slice its output:
Phi-3's ``qkv_proj`` (``[q | k | v]``, of unequal widths under grouped-query attention, sliced at the
widths its config gives) and ``gate_up_proj`` (``[gate | up]``, halved with ``chunk(2)``), GPT-2's
``c_attn``, Falcon's and Bloom's ``query_key_value``. A ``colwise`` split hands rank r the r-th
contiguous part of that output, and the model slices its local output at the whole model's widths:
rank 0 of a ``[gate | up]`` split at tp=2 takes the two halves of ``gate`` as gate and up, and trains,
wrongly. :func:`check_fused` refuses such a split before any communication, naming the styles that are
exact: the output gathered (``colwise_gather_output``, Hugging Face's own plan for Phi-3), each section
split (``packed_colwise`` for ``[gate | up]``), or dtlab's per-head recipe (``plan="auto"`` on GPT-2).
GPT-NeoX's ``query_key_value`` is laid out head by head (``[q k v]`` of head 0, then head 1, ...) and
its attention infers the head count: a ``colwise`` split there holds whole heads and is exact.

T5's attention adds a learned position bias with a column per head (``relative_attention_bias``, an
embedding computed once per stack and passed to every layer): splitting its heads leaves the bias with
all of them, a shape error inside the model; :func:`check_head_split` refuses it, naming what splits,
and so a table per head beside the projections (Cohere's q/k LayerNorm, weight ``(heads, head_dim)``).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from torch import nn

from dtlab.errors import StrategyError

__all__ = ["check_fused", "check_head_split"]

_QKV = "[q | k | v] (the model slices q, k and v at the whole model's widths)"
#: the last name part -> (what its output is, the sections a column split may keep, the exact fix)
_FUSED: dict[str, tuple[str, int | None, str]] = {
    **dict.fromkeys(["qkv_proj", "Wqkv", "W_pack", "query_key_value"], (_QKV, None, "")),
    "c_attn": (_QKV, None, "; on GPT-2, plan='auto' splits it per head (dtlab's recipe, HeadsParallel)"),
    "gate_up_proj": (
        "[gate | up] (the model halves it with chunk(2))",
        2,
        "; or 'packed_colwise' (gate and up each split over tp) with 'rowwise' on the projection after it",
    ),
}
#: model types whose projection of that name is laid out head by head, its head count inferred
_PER_HEAD = {"query_key_value": {"gpt_neox"}}


def check_fused(root: nn.Module, name: str, sections: int) -> None:
    """Refuse a column split (its output not gathered) of a Hugging Face model's (``root`` has
    ``config.model_type``) fused projection ``name`` in other sections than the model slices."""
    model_type = getattr(getattr(root, "config", None), "model_type", None)
    last = name.rpartition(".")[2]
    if not isinstance(model_type, str) or last not in _FUSED:
        return
    what, keeps, fix = _FUSED[last]
    if sections == keeps or model_type in _PER_HEAD.get(last, set()):
        return
    style = "colwise" if sections == 1 else f"a column split in {sections} sections"
    raise StrategyError(
        f"tensor-parallel plan: module {name!r} of {type(root).__name__} is a fused projection whose "
        f"output is {what}: {style} would give each rank the wrong heads or halves (wrong results, or "
        "a shape error inside the model). Use "
        "'colwise_gather_output' on it and 'rowwise_split_input' on the projection reading its output "
        f"(Hugging Face's own plan for Phi-3){fix}; or leave it out of the plan"
    )


def check_head_split(
    root: nn.Module, name: str, attention: nn.Module, heads: int | None, summed: AbstractSet[int]
) -> None:
    """Refuse splitting the heads (``heads`` of them, ``None``: not known; of projection ``name``, or of
    ``attention`` itself under the ``heads`` style) of a Hugging Face attention module with an entry per
    head that stays whole: a position bias (T5's, which has ``has_relative_attention_bias``), or in a
    module beside its projections a parameter of 2 or more dims with one dim per head (Cohere's q/k
    LayerNorm) or a list of one module per head (StableLM's per-head LayerNorms, zipped with the heads
    it is given). A module the plan leaves whole with its gradient summed over tp (``summed``: ids of the
    modules planned ``replicated_with_grad_allreduce``) is one table every head uses, as the plan says:
    a dim of it that equals the head count is not a head's."""
    if not isinstance(getattr(getattr(root, "config", None), "model_type", None), str):
        return
    if hasattr(attention, "has_relative_attention_bias"):
        raise StrategyError(
            f"tensor-parallel plan: {name!r} splits the heads of {type(attention).__name__}, whose position "
            "bias (relative_attention_bias: an embedding with a column per head, computed once per stack "
            "and added to every layer's scores) would keep every head against this rank's part, and no "
            "style splits that embedding by heads; leave the attention modules out of the plan (the "
            "feed-forward layers split exactly: 'colwise' on DenseReluDense.wi (wi_0, wi_1), 'rowwise' "
            "on DenseReluDense.wo)"
        )
    if heads is None or heads <= 1:
        return
    for child, module in attention.named_children():
        if _projection(module) or id(module) in summed:
            continue
        tables = [  # a projection's weight inside it (an adapter's, LoRA's A and B) is no table
            (f"{child}.{f'{m}.' if m else ''}{n}", tuple(p.shape))
            for m, sub in module.named_modules()
            if not _projection(sub)
            for n, p in sub.named_parameters(recurse=False)
            if p.dim() >= 2
        ]
        lists = [
            (f"{child}.{n}".rstrip("."), (len(m),))
            for n, m in module.named_modules()
            if isinstance(m, nn.ModuleList)
        ]
        hit = next(((what, shape) for what, shape in [*tables, *lists] if heads in shape), None)
        if hit is not None:
            raise StrategyError(
                f"tensor-parallel plan: {name!r} splits the {heads} heads of {type(attention).__name__}, "
                f"whose {hit[0]} {hit[1]} holds an entry per head and stays whole (a shape error inside "
                "the model, or the wrong heads' entries); no style splits it by heads: leave this "
                "attention's projections out of the plan (e.g. Cohere: use_qk_norm=False has no such "
                f"table). If {child!r} is one table every head uses (a dim of {heads} by coincidence), "
                "plan it 'replicated_with_grad_allreduce' (left whole, its gradient summed over tp, as "
                "each rank's heads give only their part of it)"
            )


def _projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
