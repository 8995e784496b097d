"""What a user reaches for on a model-parallel model as on the plain (Hugging Face) model, refused with
the fix where it would silently do something else: the wrapped module's own ``state_dict()`` (and so
``save_pretrained``) while this rank holds only its part, keyword inputs a pipeline would drop,
``labels=`` on logits split over tp, and the plain model's attributes asked of the wrapper; and the
whole state a ``model.state_dict()`` gathers (tp shards gathered, each tensor broadcast over pp),
refused where ``model.module`` was renamed since wrapping."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from dtlab.backends.base import CommunicationBackend
from dtlab.backends.mesh import MeshLike
from dtlab.core.placement import Placement, Shard, placement_of
from dtlab.errors import StrategyError
from dtlab.models.compose._build import Entries
from dtlab.models.dp._writes import pre_hook_marks, prune_hooks
from dtlab.models.pipeline._comm import broadcast_over_pp
from dtlab.models.tensor._comm import gather_over_tp
from dtlab.models.tensor._layers import VocabParallelEmbedding

__all__ = ["PartialState", "check_call", "gather_whole_state", "missing_attribute", "whole_over_tp"]

T = TypeVar("T")

_SAVE = (
    "gather the whole state on every rank, state = model.state_dict() (collective), then write it from "
    "one rank: hf_model.save_pretrained(path, state_dict=state, is_main_process=rank == 0) on the model "
    "you wrapped, or save with dtlab.checkpoint"
)


class PartialState:
    """Refuses ``state_dict()`` of the user's ``module`` where a rank holds only part of it (tp shards,
    or its pipeline stages with the others' tensors on the meta device) but for the composition's own
    copy (:meth:`read`) and the live tensors (``keep_vars=True``, where dtlab reads each rank's part):
    Hugging Face's ``save_pretrained()`` would write that part as the whole model. Over tp shards its
    ``load_state_dict()`` too (whole tensors into shards)."""

    def __init__(
        self,
        module: nn.Module,
        who: str,
        placements: Mapping[str, Placement],
        mesh: MeshLike,
        pipelined: bool,
    ) -> None:
        self.module, self.who, self.open, self.pipelined = module, who, False, pipelined
        sharded = mesh.size("tp") > 1 and any(isinstance(pl, Shard) for pl in placements.values())
        self.part = (
            "this rank's pipeline stages" if mesh.size("pp") > 1 else "its tp shards" if sharded else ""
        )
        module.register_state_dict_pre_hook(self._refuse)
        self._known = {id(c): c for c in _renamers(module)}  # kept: ids are not reused
        #: the modules at wrapping (only their weights are laid out) and their marks when last checked
        self._watched = list(module.modules())
        self._parametrized = [m for m in self._watched if parametrize.is_parametrized(m)]
        self._marks = self._marks_now()
        if sharded:  # whole tensors into tp shards (torch's size mismatch, or a silent slice)
            module.register_load_state_dict_pre_hook(self._refuse_load)
        if pipelined and callable(getattr(module, "resize_token_embeddings", None)):
            # Hugging Face's resize reads the other stages' embedding or head: a raw meta-tensor error
            vars(module)["resize_token_embeddings"] = partial(_refuse_resize, who)

    def _refuse(self, _module: nn.Module, _prefix: str, keep_vars: bool) -> None:
        if self.part and not self.open and not keep_vars:
            raise StrategyError(
                f"{self.who}: the wrapped module's own state_dict() (which save_pretrained() calls) holds "
                f"only {self.part}; saved as the whole model it would be a wrong checkpoint. To save: {_SAVE}"
            )

    def _refuse_load(self, *_: Any) -> None:
        raise StrategyError(
            f"{self.who}: the wrapped module's own load_state_dict() would load whole tensors into "
            f"{self.part}; load through the wrapper on every rank, model.load_state_dict(state) (whole "
            "tensors keyed like the plain model's; each rank keeps its part), or a Hugging Face folder "
            "with dtlab.checkpoint.load_pretrained(model, path)"
        )

    def check_unchanged(self, who: str, then: Callable[[str], None]) -> None:
        """``then(who)`` (the check before a step) after refusing ``torch.nn.utils.prune`` or a
        parametrization applied to the wrapped module since wrapping: each renames the weight (the
        layout the composition saves and loads by) and, on a split layer, acts on this rank's slice."""
        marks = self._marks_now()
        if marks != self._marks:  # a hook added or a class swapped (a first parametrization)
            new = {id(c) for c in _renamers(self.module)} - self._known.keys()
            if new:
                gone, now = [], []
                for n, m in self.module.named_modules():
                    if any(id(c) in new for c in _renamers_of(m)):
                        pruned = [p for p, _ in m.named_parameters(recurse=False) if p.endswith("_orig")]
                        params = list(_parametrized(m))
                        gone += [f"{n}.{p.removesuffix('_orig')}" for p in pruned]
                        gone += [f"{n}.{t}" for t in params]
                        now += [f"{n}.{p}" for p in pruned]
                        now += [f"{n}.parametrizations.{t}" for t in params]
                raise StrategyError(f"{self.who}: {renamed_message(gone, now)}")
            self._marks = marks  # a hook of another kind: nothing renamed
        then(who)

    def _marks_now(self) -> list[object]:
        """:func:`pre_hook_marks` of the modules at wrapping, with the number of parametrized tensors of
        those parametrized then (another one adds no hook and swaps no class)."""
        marks: list[object] = [*pre_hook_marks(self._watched)]
        return marks + [len(_parametrized(m)) for m in self._parametrized]

    def read(self, fn: Callable[[], T]) -> T:
        """``fn()`` (the data-parallel strategy's copy of the module's state) with the module open."""
        self.open = True
        try:
            return fn()
        finally:
            self.open = False


def _refuse_resize(who: str, *_: Any, **__: Any) -> None:
    raise StrategyError(
        f"{who}: resize_token_embeddings on the model after a pipeline wrapped it: this rank holds only its "
        "stages (the others' embedding or head are on the meta device) and the stages were laid out for "
        "the shapes at wrapping. Resize the plain model before wrapping it "
        "(hf_model.resize_token_embeddings(n), then wrap)"
    )


def _parametrized(module: nn.Module) -> dict[str, nn.Module]:
    """The parametrizations of ``module``'s tensors (``torch.nn.utils.parametrize``), by tensor name."""
    lists = getattr(module, "parametrizations", None)
    return (
        dict(lists.items())
        if parametrize.is_parametrized(module) and isinstance(lists, nn.ModuleDict)
        else {}
    )


def _renamers(module: nn.Module) -> list[object]:
    """What renames a weight of ``module``'s tree (walked at wrapping and after a change only)."""
    return [c for m in module.modules() for c in _renamers_of(m)]


def _renamers_of(module: nn.Module) -> list[object]:
    """Those on ``module`` itself: ``torch.nn.utils.prune`` hooks and parametrizations."""
    return [*(h for _, h in prune_hooks(module, recurse=False)), *_parametrized(module).values()]


def check_call(
    who: str, args: tuple[Any, ...], kwargs: dict[str, Any], pipelined: bool, split: bool, training: bool
) -> None:
    """Refuse a forward call that would not do what it does on the plain model: a pipeline trains
    through ``train_step`` (``training``: in training mode with autograd on) and its inference takes one
    positional tensor (the input ids; nothing else reaches the stages); ``labels=`` asks the model for
    its own loss, which sees 1/tp of the vocabulary when the logits are ``split`` over tp."""
    if pipelined and training:
        raise StrategyError(
            f"{who} with a pipeline trains through train_step((inputs, targets), loss_fn), which runs the "
            "schedule; forward() is inference only: call model.eval() or run it under torch.no_grad()"
        )
    if pipelined and (kwargs or len(args) != 1):
        raise StrategyError(
            f"{who}: a pipeline's forward() takes the input ids as its one positional argument (got "
            f"{len(args)} positional, keyword {sorted(kwargs)}); the stages run the model with its defaults "
            "for everything else, so an attention_mask, labels= or other input would be silently left out. "
            "Call model(input_ids); pad on the right with labels -100 on the pads (a causal model's "
            "other positions never see them) and compute the loss from the logits; or run the plain "
            "model, loaded from model.state_dict()"
        )
    if split and "labels" in kwargs:
        raise StrategyError(
            f"{who}: labels= asks the model for its own loss, but this tensor plan leaves the logits split "
            "over tp (the head 'colwise'): that loss would see 1/tp of the vocabulary. Leave labels out "
            "and use model.cross_entropy(out.logits[:, :-1], labels[:, 1:]) (vocabulary-parallel; labels "
            "-100 left out of the mean), or gather the head's output in the plan ('colwise_gather_output')"
        )


def missing_attribute(who: str, own: PartialState | None, name: str, exc: AttributeError) -> AttributeError:
    """The error for ``model.<name>`` the wrapper ``who`` lacks: where the model it wraps (``own.module``)
    has it, how to reach it (or why not); else ``exc`` itself."""
    if own is None or name.startswith("_") or not hasattr(own.module, name):
        return exc
    pipelined = own.pipelined
    if name == "save_pretrained":
        fix = _SAVE
    elif name == "generate" and pipelined:
        fix = (
            "a pipeline does not generate; model(input_ids) under model.eval() and torch.no_grad() gives the "
            "last stage's logits; to generate, load model.state_dict() (every rank) into the plain model"
        )
    elif name in ("resize_token_embeddings", "tie_weights"):
        fix = "call it on the plain model before wrapping it (the strategy lays out the parameters it finds)"
    elif name == "num_parameters" and own.part:
        fix = f"count the plain model before wrapping it (this rank's module holds only {own.part})"
    elif name == "generate":
        fix = "call model.module.generate(...) on every rank with the same inputs, in eval mode under no_grad"
    elif pipelined:
        fix = "use it on the model you wrapped (model.module holds only this rank's stages)"
    else:
        fix = f"use model.module.{name}"
    return AttributeError(f"{who} has no attribute {name!r} (the model it wraps has): {fix}")


def whole_over_tp(
    fn: Callable[[nn.Module], None], tp: CommunicationBackend, skip: nn.Module
) -> Callable[[nn.Module], None]:
    """``fn(m)`` for every module but ``skip``, with ``m``'s parameters split over ``tp`` whole
    (gathered for the call; each rank then keeps its slice of what ``fn`` left) and an embedding's
    ``padding_idx`` the vocabulary's: a random init draws the whole layer (its fan-in and fan-out the
    layer's; one process's values where the tp ranks' generators agree) instead of each rank its
    slice. Collective over ``tp`` per split module."""

    def run(m: nn.Module) -> None:
        if m is skip:
            return
        split = [(p, pl) for p in m.parameters(recurse=False) if isinstance(pl := placement_of(p), Shard)]
        if not split or tp.world_size == 1:
            fn(m)
            return
        emb = m if isinstance(m, VocabParallelEmbedding) else None
        pad = None if emb is None else emb.padding_idx
        if emb is not None:  # the vocabulary's padding row (one rank holds it) while fn runs
            held = tp.all_gather_object(None if pad is None else pad + emb.vocab_start)
            emb.padding_idx = next((i for i in held if i is not None), None)
        local = [p.data for p, _ in split]
        for p, pl in split:
            p.data = gather_over_tp(p.data, pl, tp)
        try:
            fn(m)
        finally:
            with torch.no_grad():
                for (p, pl), was in zip(split, local, strict=True):
                    was.copy_(pl.local_shard(p.data, tp.rank, tp.world_size))
                    p.data = was
            if emb is not None:
                emb.padding_idx = pad

    return run


def gather_whole_state(
    local: Mapping[str, torch.Tensor], entries: Entries, tp: CommunicationBackend, pp: CommunicationBackend
) -> dict[str, torch.Tensor]:
    """Every tensor of the whole model on every rank, from each pipeline rank's ``local`` tensors (whole
    over dp): tp shards gathered, then each tensor broadcast from the pipeline rank holding it."""
    gone = [k for k, (_, _, owner, _) in entries.items() if owner == pp.rank and k not in local]
    # model.module's tensors renamed since wrapping (every rank of a stage changed it alike): refused on
    # every pipeline rank, not only the stage's (the others would wait in the broadcasts below)
    flags = pp.all_gather_object(bool(gone)) if pp.world_size > 1 else [bool(gone)]
    where = [r for r, changed in enumerate(flags) if changed]
    if where:
        raise StrategyError(renamed_message(gone, [k for k in local if k not in entries], where))
    out = {}
    for key, (shape, dtype, owner, placement) in entries.items():
        mine: torch.Tensor | None = None
        if owner == pp.rank:
            mine = local[key]
            if isinstance(placement, Shard):
                mine = gather_over_tp(mine, placement, tp)
        out[key] = broadcast_over_pp(mine, shape, dtype, owner, pp)
    return out


def renamed_message(gone: list[str], new: list[str], ranks: list[int] | None = None) -> str:
    """Why tensors of the wrapped module renamed since wrapping (``gone``, now ``new``; none here: on
    pipeline ranks ``ranks``) are refused."""
    return (
        (
            f"the wrapped module's state no longer has {gone[:5]} (it has {new[:5]} instead)"
            if gone
            else f"the wrapped module's state on pipeline rank(s) {ranks} was renamed (their error names it)"
        )
        + ": model.module was changed after wrapping (torch.nn.utils.prune renames weight to "
        "weight_orig and weight_mask; a parametrization or a layer replaced). The composition laid its "
        "tensors out when it wrapped the module, and on a split layer a mask computed now comes from "
        "this rank's slice only: change the plain module before wrapping it (prune, then prune.remove() "
        "to keep the pruned values), or load model.state_dict() (every rank, before the change) into a "
        "fresh plain module, change that and wrap it"
    )
