"""The user's torch optimizer, taken apart: its class, options and param groups, and the pieces of
the model's parameters this rank steps for each group.

An optimizer strategy takes either a class and its options (``ZeRO2Optimizer(model,
torch.optim.AdamW, lr=...)``: one group of every trainable parameter) or an instance built on the
module's parameters, before or after wrapping (``ZeRO2Optimizer(model, torch.optim.AdamW(groups,
lr=...))``: its groups, options and state). Each group of the strategy maps to one group of a local
torch optimizer of the same class over this rank's pieces (:class:`Entry`): the parameters themselves
where they are replicated (DDP), views into this rank's shard of each parameter otherwise; the
group's options (learning rate, weight decay, betas, ...) are kept in step with it (:func:`sync_groups`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError, StrategyError
from dtlab.optimizers._handed import refuse_handed_again
from dtlab.optimizers._hooks import carried_hooks
from dtlab.untrusted import summary

__all__ = [
    "Entry",
    "OptimizerSpec",
    "check_groups",
    "check_members",
    "constructor_defaults",
    "group_params",
    "jsonable",
    "make_local",
    "saved_groups",
    "spec_of",
    "strangers_message",
    "sync_groups",
]

_MISSING = object()


@dataclass(frozen=True)
class OptimizerSpec:
    """What the strategy rebuilds over this rank's pieces: the class, its defaults, the groups (over
    the module's parameters), the state the user's instance already had (a torch state dict) and the
    hooks registered on it."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]
    state: dict[str, Any] | None
    #: ``(registering method, hook)`` of the hooks registered on the user's instance
    hooks: list[tuple[str, Any]]


@dataclass
class Entry:
    """Elements ``[start, end)`` of parameter ``index`` (its position over the strategy's groups, as
    in a torch state dict) are ``tensor``, which this rank's local optimizer steps."""

    index: int
    name: str
    param: torch.nn.Parameter
    numel: int
    shape: tuple[int, ...]
    tensor: torch.Tensor
    start: int
    end: int
    group: int


def refuse_sparse_only(who: str, cls: type[torch.optim.Optimizer]) -> None:
    """Refuse torch.optim.SparseAdam: every strategy hands the optimizer dense gradients."""
    if issubclass(cls, torch.optim.SparseAdam):
        raise StrategyError(
            f"{who}: {cls.__name__} steps sparse gradients only, but dtlab reduces every gradient densely "
            "(an nn.Embedding(sparse=True) gradient is summed into a dense buffer), so it would get dense "
            "ones; use torch.optim.Adam or AdamW (they update every row each step, SparseAdam only the rows "
            "looked up), or torch.optim.SGD (the same updates as with sparse gradients)"
        )


def refuse_closure_driven(who: str, cls: type[torch.optim.Optimizer]) -> None:
    """Refuse torch.optim.LBFGS: its step calls the closure several times and searches along the
    whole gradient vector; an optimizer strategy steps once per synchronized backward, over this
    rank's pieces (torch's LBFGS under it stopped with a raw TypeError, closure missing)."""
    if issubclass(cls, torch.optim.LBFGS):
        raise StrategyError(
            f"{who}: {cls.__name__} evaluates its closure several times within one step and searches "
            "along the whole gradient, while an optimizer strategy steps once after each synchronized "
            "backward, over this rank's pieces (shards under ZeRO), so it cannot drive it. Under DDPModel "
            "step a plain torch.optim.LBFGS(model.parameters(), ...) with your closure yourself: every "
            "rank holds the whole averaged gradient there, so it runs as on one process. Under ZeRO-1/2/3 "
            "and FSDP use a first-order optimizer (SGD, Adam, AdamW)"
        )


def group_params(who: str, param_group: object) -> list[torch.Tensor]:
    """The tensors of ``param_group`` that ``add_param_group`` was given, after refusing a group that is
    not a dict of ``params`` tensors (torch: "optimizer can only optimize Tensors"). Any iterable is
    taken, as torch takes it; one that reads once (a generator, ``filter(...)``, ``itertools.chain``)
    is put back into the group as the list read, as torch's own ``add_param_group`` does, which would
    otherwise get it exhausted: an empty group, its parameters silently never stepped."""
    params = param_group.get("params") if isinstance(param_group, dict) else None
    if isinstance(params, torch.Tensor):
        return [params]
    items = list(params) if isinstance(params, Iterable) else None
    if items is None or not all(isinstance(p, torch.Tensor) for p in items):
        raise TypeError(
            f"{who}.add_param_group() takes a dict whose 'params' are parameters of the wrapped module "
            f"(and the group's options), e.g. {{'params': [head.weight], 'lr': 0.01}}; got "
            f"{summary(param_group)}"
        )
    if isinstance(params, Iterator) and isinstance(param_group, dict):
        param_group["params"] = items
    return items


def strangers_message(who: str, group: int, shapes: list[tuple[int, ...]]) -> str:
    """Why param group ``group`` holding tensors that are not the wrapped module's parameters
    (``shapes``) is refused, and the fixes."""
    return (
        f"{who}: param group {group} holds tensors that are not parameters of the wrapped module (shapes "
        f"{shapes[:3]}); build the torch optimizer on model.parameters() (a data-parallel strategy keeps "
        "the module's own: before wrapping works too; tensor and pipeline parallelism hold this rank's "
        "slices or stages, new parameters: build the groups after wrapping, e.g. from "
        "model.module.named_parameters()). An optimizer strategy drives one wrapped model: for "
        "parameters of two wrapped models (an encoder and a head), wrap one module holding both "
        "(nn.ModuleDict), or give each its own optimizer strategy"
    )


def spec_of(
    who: str,
    optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
    kwargs: dict[str, Any],
    trainable: list[torch.nn.Parameter],
) -> OptimizerSpec:
    """Read the class form or the instance form (refusing a mix of both and anything else)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise TypeError(
                f"{who} got a torch optimizer instance and keyword arguments {sorted(kwargs)}; give the "
                f"options to the torch optimizer ({type(optimizer).__name__}(params, lr=...)) instead"
            )
        refuse_handed_again(optimizer, who)
        template = optimizer
        state = optimizer.state_dict() if optimizer.state else None
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        if "params" in kwargs:
            raise TypeError(
                f"{who} picks the parameters itself from the model; do not pass params= (or pass a "
                "torch optimizer built on your param groups: "
                f"{who}(model, torch.optim.AdamW(groups, lr=...)))"
            )
        template = optimizer(trainable, **kwargs)
        state = None
    else:
        raise TypeError(
            f"{who} takes a torch optimizer: an instance (torch.optim.AdamW(model.parameters(), "
            "lr=...), with any param groups) or a torch.optim.Optimizer class and its keyword "
            f"arguments (torch.optim.AdamW, lr=...), got {optimizer!r}"
        )
    refuse_sparse_only(who, type(template))
    refuse_closure_driven(who, type(template))
    # the user's instance: its own group dicts, so what changes them later (a scheduler built on it,
    # optimizer.param_groups[i]["lr"] = x) changes the strategy's (optimizers/_handed.py)
    groups = (
        list(template.param_groups) if template is optimizer else [dict(g) for g in template.param_groups]
    )
    for g in groups:
        g["params"] = list(g["params"])
    hooks = carried_hooks(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else []
    return OptimizerSpec(type(template), dict(template.defaults), groups, state, hooks)


def constructor_defaults(spec: OptimizerSpec) -> dict[str, Any]:
    """The defaults ``spec.cls``'s constructor takes: every group carries all its options; the
    constructor gets those it names (AdamW's defaults hold decoupled_weight_decay, which
    AdamW.__init__ does not take)."""
    accepted = inspect.signature(spec.cls.__init__).parameters
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    return {k: v for k, v in spec.defaults.items() if takes_any or k in accepted}


def make_local(
    spec: OptimizerSpec, who: str, groups: list[dict[str, Any]], entries: list[Entry]
) -> torch.optim.Optimizer:
    """The local torch optimizer: one group per strategy group, over that group's entries."""
    local_groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [e.tensor for e in entries if e.group == gi],
        }
        for gi, g in enumerate(groups)
    ]
    try:
        return spec.cls(local_groups, **constructor_defaults(spec))
    except Exception as exc:  # the user's constructor, given what torch's optimizers take
        name = spec.cls.__name__
        raise StrategyError(
            f"{who} rebuilds {name} over this rank's pieces as {name}(groups, **optimizer.defaults), "
            f"which failed: {type(exc).__name__}: {exc}. Pass the class and its options instead "
            f"({who}(model, {name}, lr=...)); an optimizer wrapping another (Lookahead(base)) cannot be "
            f"rebuilt so: hand the inner one to the strategy and wrap the strategy, {name}({who}(model, "
            "base)), which steps the whole parameters under DDP and ZeRO-1/2"
        ) from exc


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality
        return False


def sync_groups(
    groups: list[dict[str, Any]], local: list[dict[str, Any]], seen: list[dict[str, Any]]
) -> None:
    """Keep the strategy's groups and the local optimizer's in step, both ways: an option changed on
    the strategy's group since the last call (an LR scheduler attached to the strategy) goes to the
    local group; one changed only on the local group (a scheduler attached to ``opt.optimizer``)
    comes back. ``seen`` holds the values of the last call."""
    for g, lg, last in zip(groups, local, seen, strict=True):
        for k in set(g) | set(lg):
            if k == "params":
                continue
            mine, theirs, was = g.get(k, _MISSING), lg.get(k, _MISSING), last.get(k, _MISSING)
            if mine is not _MISSING and not _same(mine, was):
                lg[k] = mine
            elif theirs is not _MISSING and not _same(theirs, was):
                g[k] = theirs
        last.clear()
        last.update({k: v for k, v in g.items() if k != "params"})


# ---------------------------------------------------------------------------- groups in checkpoints
def _same_kind(saved: Any, live: Any) -> bool:
    if isinstance(live, torch.Tensor):
        live = 0.0  # saved as its value (see _jsonable)
    if isinstance(live, bool) or live is None:
        return isinstance(saved, bool) or saved is None
    if isinstance(live, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(live, list | tuple):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_same_kind, saved, live))
    return isinstance(saved, type(live))


def saved_groups(shards: Sequence[ShardedState], entries: list[Entry]) -> Any:
    """The saved param groups that apply here: those of a shard holding this rank's parameters (at
    pp > 1 each stage's optimizer saved its own groups, as many as that stage was given), else the
    first shard's (a checkpoint written on another layout, or without ``param_group_of``)."""
    names = {e.name for e in entries}
    found = [s.metadata for s in shards if isinstance(s.metadata, dict) and "param_groups" in s.metadata]
    for md in found:
        held = md.get("param_group_of")
        if isinstance(held, dict) and not names.isdisjoint(held):
            return md["param_groups"]
    return found[0]["param_groups"] if found else None


def check_groups(saved: Any, groups: list[dict[str, Any]], agree: Callable[[bool], bool]) -> bool:
    """Saved param-group hyperparameters must be a list of as many groups as the live ones, of the kind
    the live groups hold (a number where a number is): else a :class:`CheckpointError` naming the value,
    before anything is set, on every rank alike (``agree``: at pp > 1 each stage checks its own saved
    groups, and a stage refusing alone would leave the others waiting in the next collective). Returns
    whether groups were saved (then as many as here)."""
    if saved is None:  # alike on every rank: every rank reads the same shards
        return False
    problem = _groups_problem(saved, groups)
    if agree(problem is None):
        return True
    raise CheckpointError(
        problem
        or "the checkpoint's optimizer param groups saved for another rank (pipeline stage) do not fit its "
        "optimizer (its error names them); nothing was loaded. Build the param groups as when saving, or "
        "do not load the optimizer state (start it fresh; checkpoint.reset_optimizer=true in dtlab train)"
    )


def _groups_problem(saved: Any, groups: list[dict[str, Any]]) -> str | None:
    """Why ``saved`` (a checkpoint's param groups) cannot apply to ``groups``, or None."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        return f"optimizer shard metadata: param_groups={summary(saved)}, expected a list of objects"
    if len(saved) != len(groups):  # torch's load_state_dict refuses it too
        return (
            f"the checkpoint's optimizer has {len(saved)} param group(s), this one {len(groups)}: the saved "
            "options (lr, weight_decay, ...) and a scheduler's state are per group, by position. Build the "
            "param groups as when saving, or do not load the optimizer state (start it fresh; "
            "checkpoint.reset_optimizer=true in dtlab train)"
        )
    for i, (values, group) in enumerate(zip(saved, groups, strict=True)):
        for k, v in values.items():
            if k in group and k != "params" and not _same_kind(v, group[k]):
                return (
                    f"optimizer shard metadata: param_groups[{i}].{k}={summary(v)}, but the optimizer "
                    f"holds {summary(group[k])} there"
                )
    return None


def check_members(
    shards: Sequence[ShardedState],
    entries: list[Entry],
    saved: list[dict[str, Any]],
    who: str,
    agree: Callable[[bool], bool],
) -> None:
    """Saved param-group options apply by position (``saved``: the groups applied here): refuse, on
    every rank alike (``agree``), when a parameter would take options other than those of the group it
    was in when saved (``metadata["param_group_of"]``, every rank's ``{name: group}``, numbered in that
    shard's own ``param_groups``: each pipeline stage numbers its own), e.g. groups built in another
    order. A layout that numbers the groups otherwise (another pipeline split) passes where the options
    agree."""
    was: dict[str, dict[str, Any]] = {}  # a parameter's options when saved
    for s in shards:
        held, groups = s.metadata.get("param_group_of", {}), s.metadata.get("param_groups")
        if not isinstance(held, dict) or not all(isinstance(g, int) for g in held.values()):
            raise CheckpointError(
                f"optimizer shard metadata: param_group_of={summary(held)}, expected names -> group numbers"
            )
        if not held:
            continue
        if not (isinstance(groups, list) and all(0 <= g < len(groups) for g in held.values())) or not all(
            isinstance(groups[g], dict) for g in held.values()
        ):
            raise CheckpointError(
                f"optimizer shard metadata: param_group_of={summary(held)} does not fit "
                f"param_groups={summary(groups)} (a list of objects, one per group it numbers)"
            )
        was.update({name: groups[g] for name, g in held.items()})
    moved = next((e for e in entries if was.get(e.name, saved[e.group]) != saved[e.group]), None)
    if agree(moved is None):
        return
    said, here = "another rank's parameter", ""
    if moved is not None:
        then, now = was[moved.name], saved[moved.group]
        differ = sorted(k for k in {*then, *now} if then.get(k) != now.get(k))
        said = repr(moved.name)
        here = (
            f" (saved with {', '.join(f'{k}={then.get(k)!r}' for k in differ)}; here in group "
            f"{moved.group}, whose saved options are {', '.join(f'{k}={now.get(k)!r}' for k in differ)})"
        )
    raise CheckpointError(
        f"{who}.load_sharded_state_dict(): {said} is in another param group than when the checkpoint was "
        f"written{here}; the saved groups' options (lr, weight_decay, ...) apply by position, so it would "
        "take another group's. Build the param groups as when saving (same order, same parameters in each), "
        "or do not load the optimizer state (start it fresh; checkpoint.reset_optimizer=true in dtlab train)"
    )


def jsonable(group: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else None
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, bool | int | float | str | list):
            out[k] = v
    return out
