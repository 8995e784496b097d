"""Optimizer state whole and keyed like a plain torch optimizer's ``state_dict()``.

``{"state": {i: {"exp_avg": tensor of the parameter's shape, "step": ...}}, "param_groups": [...,
"params": [i, ...]]}`` with ``i`` a parameter's position over the groups, exactly as torch writes it,
so a plain script resumes from it and the strategy resumes from a plain script's. Under a sharded
strategy building it is collective (every rank calls: each unit's state is all-gathered); loading is
not (each rank keeps the slice of each tensor it steps). Under tensor or pipeline parallelism a rank
holds a part of the model (its tp slices, its stages): the state dict is that part's, marked with it
(:data:`PART`), and loading another rank's part is refused on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, StrategyError, every_rank_saves
from dtlab.models.base import OptimizerTarget
from dtlab.optimizers._groups import Entry, jsonable

__all__ = ["PART", "check_part", "full_state", "load_full_state", "model_part"]

#: the key of the state dict naming the part of the model a tp or pipeline rank's state is of
PART = "dtlab_part"
_FIX = (
    "Under tensor and pipeline parallelism opt.state_dict() is this rank's part (its tp slices, its "
    "stages): save one per rank and load each rank's own (torch.save(opt.state_dict(), "
    "f'opt_{rank}.pt')), or save opt.sharded_state_dict() with dtlab.checkpoint (any mesh)"
)


def _tensor_state(e: Entry, key: str, v: torch.Tensor, who: str) -> bool:
    """True for element-wise state (one value per element), False for a scalar such as ``step``."""
    if v.dim() == 0:
        return False
    if v.shape != e.tensor.shape:
        raise StrategyError(
            f"{who}: optimizer state {key!r} of {e.name!r} has shape {tuple(v.shape)}, not the "
            f"parameter piece's {tuple(e.tensor.shape)}; only element-wise optimizer state (SGD, Adam, "
            "AdamW, RMSprop, ...) can be gathered whole and resharded"
        )
    return True


def _scalar(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def full_state(
    entries: list[Entry],
    local: torch.optim.Optimizer,
    model: OptimizerTarget,
    index_of: dict[int, int],
    sharded: bool,
    who: str,
) -> dict[int, dict[str, Any]]:
    """Every parameter's whole state (collective when ``sharded``); ``index_of`` maps ``id(param)`` to
    its index for every parameter of the groups (also those of which this rank holds nothing)."""
    if not sharded:
        out: dict[int, dict[str, Any]] = {}
        for e in entries:
            st = local.state.get(e.tensor)
            if st:  # whole parameters: any state as torch holds it (Adafactor's factored row_var too)
                out[e.index] = {k: _scalar(v) for k, v in st.items()}
        return dict(sorted(out.items()))
    return _gathered_state(entries, local, model, index_of, who)


def _gathered_state(
    entries: list[Entry],
    local: torch.optim.Optimizer,
    model: OptimizerTarget,
    index_of: dict[int, int],
    who: str,
) -> dict[int, dict[str, Any]]:
    """The sharded case: each unit's element-wise state all-gathered, scalars exchanged as objects;
    a parameter no rank holds state for (not stepped yet: unused so far, or of 0 elements) gets none,
    as in torch, not the zeros of its unit's element-wise keys without its scalars (a torch optimizer
    loading that stopped at its step: KeyError 'step')."""
    units = model.shard_units()
    slot_of = {id(u.params[j]): (ui, s) for ui, u in enumerate(units) for j, s in enumerate(u.slots)}
    kinds: dict[int, dict[str, str]] = {}  # unit -> element-wise state key -> dtype
    scalars: dict[int, dict[str, Any]] = {}
    held = {e.index for e in entries if local.state.get(e.tensor)}  # parameters with state here
    for e in entries:
        for k, v in local.state.get(e.tensor, {}).items():
            if isinstance(v, torch.Tensor) and _tensor_state(e, k, v, who):
                kinds.setdefault(slot_of[id(e.param)][0], {})[k] = str(v.dtype).removeprefix("torch.")
            else:
                value = (
                    (v.item(), str(v.dtype).removeprefix("torch."))
                    if isinstance(v, torch.Tensor)
                    else (v, None)
                )
                scalars.setdefault(e.index, {})[k] = value
    backend = model.dp_backend
    out: dict[int, dict[str, Any]] = {}
    all_kinds: dict[int, dict[str, str]] = {}
    options = [jsonable(g) for g in local.param_groups]  # the strategy's, synchronized at state_dict()
    try:
        gathered = backend.all_gather_object((kinds, scalars, options, held))
    except (CollectiveTimeoutError, CollectiveMismatchError) as exc:  # if rank == 0: torch.save(opt...)
        raise StrategyError(
            f"{who}.state_dict() on rank {backend.rank} did not meet the other ranks: "
            f"{every_rank_saves('opt.state_dict()', '1/P of the optimizer state')} ({exc})"
        ) from exc
    _check_same_options([g for _, _, g, _ in gathered], who)
    stepped = set().union(*(h for _, _, _, h in gathered))
    for theirs, their_scalars, _, _ in gathered:
        for ui, ks in theirs.items():
            all_kinds.setdefault(ui, {}).update(ks)
        for i, st in their_scalars.items():
            for k, (value, dtype) in st.items():
                out.setdefault(i, {})[k] = (
                    value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
                )
    for ui in sorted(all_kinds):
        unit = units[ui]
        lo, _ = unit.shard_bounds()
        mine_entries = [e for e in entries if slot_of[id(e.param)][0] == ui]
        for k, dtype_name in sorted(all_kinds[ui].items()):
            dtype = getattr(torch, dtype_name)
            mine = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
            for e in mine_entries:
                v = local.state.get(e.tensor, {}).get(k)
                if isinstance(v, torch.Tensor):
                    at = slot_of[id(e.param)][1].offset + e.start - lo
                    mine[at : at + e.end - e.start].copy_(v.reshape(-1))
            whole = torch.empty(unit.padded, dtype=dtype, device=unit.device)
            backend.all_gather(whole, mine)
            for p, s in zip(unit.params, unit.slots, strict=True):
                i = index_of.get(id(p))
                if i is not None and i in stepped:
                    out.setdefault(i, {})[k] = whole[s.offset : s.offset + s.numel].view(s.shape).clone()
    return dict(sorted(out.items()))


def _check_same_options(options: list[list[dict[str, Any]]], who: str) -> None:
    """Refuse, on every rank alike, param-group options that differ between the ranks of one data-parallel
    group: each stepped its shard with its own (a scheduler stepped with a per-rank value)."""
    for r, theirs in enumerate(options):
        for gi, (a, b) in enumerate(zip(options[0], theirs, strict=True)):
            differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            if differ:
                k = differ[0]
                raise StrategyError(
                    f"{who}.state_dict(): param group {gi}'s {k!r} is {a.get(k)!r} on rank 0 but "
                    f"{b.get(k)!r} on rank {r}: each rank stepped its shard with its own options. Every rank "
                    "must set the "
                    "same: a scheduler stepped with a value each rank computed on its own data "
                    "(ReduceLROnPlateau(opt).step(this rank's validation loss)) or on one rank only changes "
                    "them on some ranks; average the metric over the ranks first and step schedulers on "
                    "every rank"
                )


def _factored(v: torch.Tensor, param: torch.Tensor) -> bool:
    """True for state of a whole parameter factored over some of its dimensions (Adafactor's
    ``row_var``, of shape ``(rows, 1)``): its dimensions are the parameter's or 1, not all the same.
    Any other shape than the parameter's is state of another model, or of a part of this one."""
    if v.dim() != param.dim() or v.shape == param.shape:
        return False
    return all(a in (b, 1) for a, b in zip(v.shape, param.shape, strict=True))


def whole_hint(saved: Any, here: list[list[Any]] | None) -> str:
    """What to add to a refusal of a state dict that does not fit: on a rank holding a part of the
    model (``here``), a state dict without a part (``saved``: its :data:`PART`) is a whole model's."""
    if here is None or saved is not None:
        return ""
    return (
        ". It is a whole model's optimizer state (a plain torch optimizer's, or one saved under DDP or "
        "ZeRO), which a tensor- or pipeline-parallel rank cannot load: it holds only its tp slices or "
        "its stages. Load it under DDPOptimizer (whole parameters), save opt.sharded_state_dict() with "
        "dtlab.checkpoint, and load that here (it reshards to any mesh)"
    )


def load_full_state(
    entries: list[Entry],
    local: torch.optim.Optimizer,
    state: dict[Any, Any],
    who: str,
    whole: bool,
    hint: str = "",
) -> None:
    """Give every entry its slice of ``state`` (``{param index: {key: value}}``, torch's layout);
    ``whole``: every entry is a whole parameter, whose factored state loads as torch loads it;
    ``hint``: added to a refusal (:func:`whole_hint`)."""
    local.state.clear()
    for e in entries:
        saved = state.get(e.index, state.get(str(e.index)))
        if not saved:
            continue
        numel = e.numel
        st: dict[str, Any] = {}
        for k, v in saved.items():
            if isinstance(v, torch.Tensor) and whole and _factored(v, e.tensor):
                dtype = e.tensor.dtype if v.is_floating_point() else v.dtype
                st[k] = v.detach().to(device=e.tensor.device, dtype=dtype).clone()
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.numel() != numel:
                    raise StrategyError(
                        f"{who}.load_state_dict(): state {k!r} of parameter {e.index} ({e.name!r}) has "
                        f"{v.numel()} elements but the parameter has {numel}; the state dict was saved "
                        f"for another model or other param groups{hint}"
                    )
                piece = v.detach().reshape(-1)[e.start : e.end]
                dtype = e.tensor.dtype if v.is_floating_point() else v.dtype
                st[k] = piece.to(device=e.tensor.device, dtype=dtype).clone().view(e.tensor.shape)
            else:
                st[k] = _scalar(v)
        local.state[e.tensor] = st


def model_part(model: OptimizerTarget, indexed: dict[int, tuple[int, int, str]]) -> list[list[Any]] | None:
    """``[index, name, coordinate, size]`` of each parameter this rank steps, its coordinate and size
    on the axis it is split over (tensor parallelism; names tell pipeline stages apart), where a rank
    holds a part of the model (its world is larger than its data-parallel group); else None."""
    if model.world_backend.world_size == model.dp_backend.world_size:
        return None
    out: list[list[Any]] = []
    for i, _, name in sorted(indexed.values()):
        _, coordinate, size = model.placed(name)
        out.append([i, name, coordinate, size])
    return out


def _wrong_part(saved: Any, here: list[list[Any]], who: str) -> str | None:
    """Why a state dict of another rank's part of the model (``saved``: its :data:`PART`) cannot load
    here, or None; a plain torch optimizer's (no part) is checked by each state tensor's size."""
    if saved is None or saved == here:
        return None
    listed = saved if isinstance(saved, list) else []
    theirs = {p[0]: p for p in listed if isinstance(p, list) and len(p) == 4}
    diff = next((p for p in here if theirs.get(p[0]) != p), None) or here[0]
    other = theirs.get(diff[0])
    said = "no parameter" if other is None else f"{other[1]!r} piece {other[2]} of {other[3]}"
    return (
        f"{who}.load_state_dict(): the state dict is another rank's part of the model: parameter "
        f"{diff[0]} is {diff[1]!r} piece {diff[2]} of {diff[3]} here, {said} in the state dict. {_FIX}"
    )


def check_part(saved: Any, here: list[list[Any]] | None, who: str, agree: Callable[[bool], bool]) -> str:
    """On a rank holding a part of the model (``here``: :func:`model_part`), refuse on every rank (one
    consensus: ``agree``) when any rank was given another rank's part. Returns what to add to a
    later refusal of a state dict that does not fit (:func:`whole_hint`)."""
    if here is None:
        return ""
    wrong = _wrong_part(saved, here, who)
    if not agree(wrong is None):
        raise StrategyError(
            wrong
            or f"{who}.load_state_dict(): another rank was given another rank's part of the model "
            f"(its error names the parameter). {_FIX}"
        )
    return whole_hint(saved, here)
