"""Tied (shared) parameters under the model-parallel composition: never silently untied.

A parameter reachable under two names (GPT-2's ``lm_head.weight`` *is* ``transformer.wte.weight``) is
one weight. The tensor plan swaps modules for parallel versions holding copies of shards, which would
give each user its own copy; a pipeline puts blocks on different ranks. So, before any communication:

- tensor parallelism keeps the tie when the plan splits the copies the same way: an ``nn.Embedding``
  made ``"vocab"`` and an ``nn.Linear`` made ``"colwise"`` (one section) share the weight's dim 0 (the
  vocabulary) identically, so after the swap the linear layer is given the embedding's shard
  (:func:`_retie`); a tie the plan does not touch stays as it is; any other tie the plan touches is
  refused, naming the tied parameters;
- a pipeline keeps a parameter used by stages on several ranks tied as Megatron-LM does
  (:mod:`dtlab.models.pipeline._ties`; :class:`TiedSync` sums the copies' gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.broadcast import broadcast_from_rank0
from dtlab.core.placement import Shard, placement_of
from dtlab.core.torch_private import MODULE_HOOKS, TENSOR_HOOKS
from dtlab.errors import StrategyError
from dtlab.models.dp.zero1 import ZeRO1Model
from dtlab.models.pipeline._ties import CrossTie, rebind_ties, sum_tied
from dtlab.models.tensor._auto import declared_plan
from dtlab.models.tensor._plan import (
    ColwiseParallel,
    HeadsParallel,
    Plan,
    SequenceParallel,
    Style,
    VocabParallel,
    apply_plan,
    resolve_plan,
)

if TYPE_CHECKING:
    from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["TiedSync", "swap_layers", "tied_groups"]

Resolved = list[tuple[str, nn.Module, Style]]

#: ``(linear module name, embedding module name)``: the linear layer's weight becomes the embedding's
Retie = tuple[str, str]

_FIX = (
    "keep the tie by making the embedding 'vocab' and the output layer 'colwise' in the plan (both split "
    "the vocabulary dimension the same way), leave both out of the plan, or untie them in the model "
    "before wrapping (e.g. Hugging Face: config.tie_word_embeddings=False; this changes the model)"
)


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The names of every parameter reachable under more than one name, one list per parameter."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _touched_layers(resolved: Resolved) -> dict[str, Style]:
    """Module names whose parameters the plan replaces (or marks as partial sums), with the style."""
    out: dict[str, Style] = {}
    for name, _module, style in resolved:
        if isinstance(style, HeadsParallel):
            out.update((f"{name}.{child}", style) for child in (*style.qkv, style.out))
        elif not (isinstance(style, SequenceParallel) and style.split_output):  # that only hooks the output
            out[name] = style
    return out


def _check_tied(who: str, module: nn.Module, touched: dict[str, Style]) -> list[Retie]:
    """Every tie check, before any communication; returns the ties :func:`_retie` restores after the
    tensor plan's swap."""
    out: list[Retie] = []
    for names in tied_groups(module):
        hits = {n: next(((m, st) for m, st in touched.items() if n.startswith(m + ".")), None) for n in names}
        if all(h is None for h in hits.values()):
            continue  # the plan leaves every user whole: still one parameter
        weights = [h for n, h in hits.items() if h and n == h[0] + ".weight"]  # a layer's own weight
        vocab = [m for m, st in weights if isinstance(st, VocabParallel)]
        col = [m for m, st in weights if isinstance(st, ColwiseParallel) and st.sections == 1]
        if len(names) == 2 and len(vocab) == 1 and len(col) == 1:
            out.append((col[0], vocab[0]))
            continue
        how = ", ".join(
            f"{n}: {type(h[1]).__name__} on {h[0]!r}" if h else f"{n}: not in the plan"
            for n, h in hits.items()
        )
        raise StrategyError(
            f"{who}: {' and '.join(repr(n) for n in names)} are one tied parameter, and the tensor plan "
            f"would split its users differently ({how}), silently untying them; {_FIX}"
        )
    return out


def _retie(root: nn.Module, ties: Sequence[Retie]) -> None:
    """After the swap: each column-parallel output layer uses its vocabulary-parallel embedding's
    weight (the same rows of the same tensor), so the two stay one parameter."""
    for linear, embedding in ties:
        emb_weight = getattr(root.get_submodule(embedding), "weight", None)
        lin = root.get_submodule(linear)
        lin_weight = getattr(lin, "weight", None)
        if not (isinstance(emb_weight, nn.Parameter) and isinstance(lin_weight, nn.Parameter)) or (
            lin_weight.shape != emb_weight.shape
        ):
            raise StrategyError(
                f"tied weight: {linear}.weight and {embedding}.weight differ after the tensor-parallel "
                f"swap (shapes {getattr(lin_weight, 'shape', None)} and "
                f"{getattr(emb_weight, 'shape', None)}); {_FIX}"
            )
        lin.weight = emb_weight


def swap_layers(
    who: str, module: nn.Module, plan: Plan, tp: CommunicationBackend, broadcast: bool
) -> tuple[list[nn.Parameter], dict[int, torch.Tensor]]:
    """``plan`` (``"auto"``: the one the module declares) applied to ``module`` in place, every check
    and the ties' made before any communication, ties kept (``broadcast``: rank 0's values over ``tp``
    first). Returns the parameters with partial gradients (sequence parallelism) and each replaced
    parameter (by id) -> the tensor-parallel parameter replacing it. A ``.grad`` left from before
    wrapping adds into the first step as under DDP: each split parameter gets its part of it, and a
    parameter whose gradient is summed over tp keeps it on tp rank 0 only (counted once)."""
    resolved = resolve_plan(module, declared_plan(module, plan), tp.world_size)
    touched = _touched_layers(resolved)
    ties = _check_tied(who, module, touched)
    before = {
        path: module.get_submodule(path)
        for path, st in touched.items()
        if not isinstance(st, SequenceParallel)
    }
    for path, old in before.items():
        _check_replaceable(who, path, old)
    if broadcast:  # the data-parallel strategy then broadcasts over dp
        broadcast_from_rank0(module.state_dict(keep_vars=True).values(), tp)
    partial = apply_plan(module, resolved, tp)
    _retie(module, ties)
    swapped: dict[int, torch.Tensor] = {}
    for path, old in before.items():
        new = module.get_submodule(path)
        for pname, p in old.named_parameters(recurse=False):
            q = swapped.setdefault(id(p), getattr(new, pname))
            if p.grad is not None and q.grad is None:  # left from before wrapping: this rank's part of it
                placement = placement_of(q)
                if isinstance(placement, Shard):
                    q.grad = placement.local_shard(p.grad, tp.rank, tp.world_size)
                else:
                    q.grad = p.grad.clone()
    if tp.rank:  # whole on every tp rank, then summed over tp: counted once
        for q in partial:
            q.grad = None
    return partial, swapped


def _check_replaceable(who: str, path: str, layer: nn.Module) -> None:
    """Refuse a layer the plan replaces carrying hooks of the user's (on it or its parameters), which the
    parallel layer would silently drop."""
    hooks = [
        *(f"{call} ({path})" for call, read in MODULE_HOOKS.items() if read(layer)),
        *(
            f"{call} ({path}.{n})"
            for n, q in layer.named_parameters(recurse=False)
            for call, read in TENSOR_HOOKS.items()
            if read(q)
        ),
    ]
    if hooks:
        forward_hooks = MODULE_HOOKS["register_forward_hook"](layer).values()
        hf = _HF_INPUT_GRADS in {getattr(h, "__name__", "") for h in forward_hooks}
        raise StrategyError(
            f"{who}: the tensor plan replaces {path!r} by a tensor-parallel layer, so your hooks on it "
            f"({', '.join(hooks)}) would silently never run. "
            + (
                "Hugging Face's gradient_checkpointing_enable() registered it (enable_input_require_grads(): "
                "the embedding's output made to require grad, needed only where the embedding is frozen): "
                "call hf_model.disable_input_require_grads() after it, before wrapping, or call "
                "model.module.gradient_checkpointing_enable() after wrapping instead (without a pipeline)"
                if hf
                else f"Register them after wrapping, on model.module.get_submodule({path!r}) or its "
                "parameters: they then see this rank's piece of the output and of the gradient"
            )
        )


#: the forward hook Hugging Face's ``enable_input_require_grads()`` puts on the input embedding (its
#: ``gradient_checkpointing_enable()`` calls it)
_HF_INPUT_GRADS = "make_inputs_require_grads"


class TiedSync:
    """The weights tied across pipeline ranks (``ties``) kept in sync: their gradients summed over each
    tie group before the dp reduction, or after it where the strategy leaves whole averaged gradients,
    and counted once in the gradient norm. A sum kept into the next step (gradients accumulated over
    ``train_step`` calls without ``zero_grad()`` in between, as on one process) is counted once: see
    :meth:`before_accumulate`."""

    def __init__(self, ties: list[CrossTie], root: nn.Module, dp: DataParallelModel) -> None:
        self.ties, self.dp = ties, dp
        self._summed = False  #: whether the copies' gradients may hold their sum since the last step began
        rebind_ties(ties, root)  # a strategy built from the meta device gives its parameters new objects
        #: a weight tied across ranks counts once in the norm, on the first rank of its tie group
        copies = {id(t.param) for t in ties if t.param is not None and t.group is not None and t.group.rank}
        self.norm_skip = {n for n, p in root.named_parameters(remove_duplicate=False) if id(p) in copies}
        self._names = {id(p): n for n, p in root.named_parameters()}
        if self.ties:
            dp.register_post_sync_hook(self.after_reduce)

    def _after(self) -> bool:
        """Whether the copies are summed after the dp reduction (whole, averaged gradients: DDP and
        ZeRO-1 all-reducing) rather than before it (slices of the copies at different offsets)."""
        if isinstance(self.dp, ZeRO1Model):
            return self.dp.gradient_sync == "all_reduce"
        return self.dp.keeps_whole_grads

    def before_reduce(self) -> None:
        """Before the dp reduction: each copy's local accumulated gradient summed over its group."""
        if self.ties and not self._after():
            sum_tied(self.ties, [None if t.param is None else t.param.grad for t in self.ties])
            self._summed = True

    def after_reduce(self) -> None:
        """After the dp average: each copy's whole gradient summed over its group."""
        if self._after():
            sum_tied(self.ties, self._whole_grads())
            self._summed = True

    def _whole_grads(self) -> list[torch.Tensor | None]:
        """Each copy's gradient in the strategy's whole buckets (``param.grad`` may be a stand-in)."""
        grads = dict(self.dp.whole_grads())
        return [None if t.param is None else grads.get(self._names.get(id(t.param), "")) for t in self.ties]

    def before_accumulate(self) -> None:
        """Before a step's micro-batches add into the gradients: where the strategy keeps whole gradient
        buckets (DDP, ZeRO-1), a sum over the tie group still held there (no ``zero_grad()`` since) stays
        on the group's first copy only, so the next sum counts it once, not once per copy. (ZeRO-2/3 and
        FSDP keep the sum in their shards and sum only the new local gradients.)"""
        if not self._summed:
            return
        self._summed = False
        if not self.dp.keeps_whole_grads:
            return
        for t, held in zip(self.ties, self._whole_grads(), strict=True):
            if held is not None and t.group is not None and t.group.rank:
                held.zero_()
