"""What the DDP and ZeRO optimizer strategies share: construction checks, the global gradient norm,
the finite-gradient consensus and the reshardable optimizer-state format (see dtlab.core.shard_index)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.core import pairs
from dtlab.core.shard_index import (
    ShardIndex,
    add_placed_slice,
    add_scalar,
    dtype_from_str,
    new_state,
    read_placed,
)
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError, StrategyError
from dtlab.models.base import ModelStrategy, OptimizerTarget
from dtlab.optimizers._clip import clip_by_global_norm, clip_by_value
from dtlab.optimizers._elementwise import check_pieces, steps_slices
from dtlab.optimizers._groups import (
    Entry,
    check_groups,
    check_members,
    group_params,
    jsonable,
    make_local,
    saved_groups,
    spec_of,
    strangers_message,
    sync_groups,
)
from dtlab.optimizers._handed import hand_over
from dtlab.optimizers._hooks import carry_hooks, load_with_hooks, state_dict_with_hooks
from dtlab.optimizers._outside_grads import OutsideGrads
from dtlab.optimizers._state_view import StateView, replace_state
from dtlab.optimizers._tied_groups import check_tied_groups
from dtlab.optimizers._torch_state import PART, check_part, full_state, load_full_state, model_part
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.untrusted import summary

__all__ = ["DataParallelOptimizer", "Piece"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of parameter ``name`` lie at ``offset`` of an optimizer tensor."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    offset: int


class DataParallelOptimizer(OptimizerStrategy):
    """Base of DDPOptimizer and the ZeRO optimizers: a ``torch.optim.Optimizer`` whose param groups
    are the user's (over the module's parameters), stepping them through one local torch optimizer of
    the same class over this rank's pieces (:mod:`dtlab.optimizers._groups`)."""

    strategy_name: ClassVar[str] = "dp"
    #: the local optimizer steps pieces of shards (state gathered for ``state_dict()``)
    _sharded_state: ClassVar[bool] = False

    def __init__(
        self,
        model: ModelStrategy,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        **kwargs: Any,
    ) -> None:
        me = type(self).__name__
        if not isinstance(model, OptimizerTarget):
            fitting = ", ".join(map(pairs.model_class_name, self.compatible_models))
            raise StrategyError(
                f"{me} drives a dtlab model strategy ({fitting}), got "
                f"{type(model).__name__}; wrap the module first, e.g. {me}({self._model_hint()}(module, "
                "backend), torch.optim.AdamW, lr=...)"
            )
        if model.strategy_name not in self.compatible_models:
            fix = (
                pairs.optimizer_class_name(pairs.default_optimizer(model.strategy_name))
                if model.strategy_name in pairs.PAIRINGS
                else "the matching optimizer strategy"
            )
            raise StrategyError(
                f"{me} cannot drive a {type(model).__name__} (strategy {model.strategy_name!r}); it works "
                f"with {', '.join(map(pairs.model_class_name, self.compatible_models))}. Use {fix} with "
                f"{type(model).__name__}, or wrap the module in {self._model_hint()} to use {me}"
            )
        self.model = model
        self._ready = False
        self._module_params = {id(p) for p in model.module.parameters()}
        gone = [n for n, p in model.trainable_parameters() if id(p) not in self._module_params]
        if gone:  # else add_param_group would call them strangers to the module, hiding why
            raise StrategyError(
                f"{me}: parameters {gone[:5]} of {type(model).__name__} are no longer in its module: a layer "
                "of model.module was replaced after wrapping (a LoRA wrapper, a new head), whose new params "
                "the wrapper would never average. Make the change on the plain module before wrapping it"
            )
        self._outside = OutsideGrads()  # gradients outside the groups: kept as torch keeps them
        spec = spec_of(me, optimizer, kwargs, [p for _, p in model.trainable_parameters()])
        torch.optim.Optimizer.__init__(self, spec.groups, spec.defaults)
        check_tied_groups(me, model, self.param_groups)  # before any step: tied copies stepped alike
        self._entries = self._build()
        self._kind = self._pieces_kind()
        check_pieces(me, spec, self.param_groups, model, self._kind)  # Adafactor, Muon, LAMB, group norms
        self._opt = make_local(spec, me, self.param_groups, self._entries)
        self._seen: list[dict[str, Any]] = [{} for _ in self.param_groups]
        self._sync_groups()
        self._ready = True
        model.attach_optimizer(self)
        if spec.state is not None:  # the user's optimizer came with state (e.g. a plain checkpoint)
            self._load_state_dict(spec.state)  # its load hooks ran when the user loaded it
        carry_hooks(spec.hooks, self)  # the user's instance's hooks act on this optimizer now
        if isinstance(optimizer, torch.optim.Optimizer):
            hand_over(optimizer, me, self)  # its step() and state dicts refuse, naming this optimizer's

    def _model_hint(self) -> str:
        return pairs.model_class_name(self.compatible_models[0]) if self.compatible_models else "DDPModel"

    @property  # type: ignore[override]
    def state(self) -> StateView:
        """This rank's optimizer state, keyed by the tensors the local optimizer steps (the parameters
        under DDP; pieces of shards otherwise, where ``opt.state[param]`` is refused naming the fix)."""
        refused = frozenset(self._module_params) if self._kind == "flat" else frozenset()
        return StateView(self._opt, refused, type(self).__name__)

    @state.setter
    def state(self, value: Any) -> None:
        if self._ready:  # torch's __init__ sets it first: the local optimizer's is the state
            replace_state(self._opt, value, [e.tensor for e in self._entries], type(self).__name__)

    def _pieces_kind(self) -> str | None:
        """``"flat"`` when the local optimizer steps flat shards of parameters, ``"slices"`` when
        tensor-parallel slices (a parameter placed ``Shard`` over an axis of size > 1), else ``None``."""
        return "slices" if steps_slices(self.dp_model) else None

    def _build(self) -> list[Entry]:
        """The pieces this rank steps, for every parameter of every group (see :class:`Entry`)."""
        raise NotImplementedError

    def _indexed(self) -> dict[int, tuple[int, int, str]]:
        """``id(param) -> (index, group, name)`` of every trainable parameter in the groups."""
        names = {id(p): n for n, p in self.dp_model.trainable_parameters()}
        out: dict[int, tuple[int, int, str]] = {}
        i = 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in names:
                    out[id(p)] = (i, gi, names[id(p)])
                i += 1
        return out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``: the group's parameters must belong to the wrapped module (and be
        in no other group); its options act from the next step."""
        plist = group_params(type(self).__name__, param_group)
        strangers = [tuple(p.shape) for p in plist if id(p) not in self._module_params]
        if strangers:
            raise StrategyError(strangers_message(type(self).__name__, len(self.param_groups), strangers))
        self._outside.check_added(type(self).__name__, plist)  # before torch adds the group
        super().add_param_group(param_group)
        if self._ready:
            gi = len(self.param_groups) - 1
            added = [e for e in self._build() if e.group == gi]
            self._entries.extend(added)
            group = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
            self._opt.add_param_group({**group, "params": [e.tensor for e in added]})
            self._seen.append({})
            self._sync_groups()

    def _sync_groups(self) -> None:
        sync_groups(self.param_groups, self._opt.param_groups, self._seen)

    @property
    def dp_model(self) -> OptimizerTarget:
        model = self.model
        if not isinstance(model, OptimizerTarget):
            raise StrategyError("the model is not a data-parallel model strategy")  # checked at construction
        return model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The local torch optimizer over this rank's pieces (its groups follow this one's)."""
        return self._opt

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step with the synchronized gradients (``closure``, if given, runs first under
        grad mode: the forward and backward)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups()
        model = self.dp_model
        model.check_grads_ready(type(self).__name__)
        self._step_local(model.unused_params())  # without a gradient (no rank used it): left out, as torch
        model.after_optimizer_step()
        return loss

    def _step_local(self, skip: frozenset[int]) -> None:
        """Step every entry but those of the parameters in ``skip`` (ids)."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the synchronized gradients of the groups' parameters (see :mod:`._outside_grads`). As in
        torch, a parameter whose gradient ``set_to_none=False`` zeroed is stepped from then on."""
        self._outside.zero_grad(self.dp_model, self.param_groups, set_to_none)

    # ------------------------------------------------------------------ torch's state dict
    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state keyed like the plain torch optimizer's ``state_dict()`` (a plain
        script loads it); collective under ZeRO-1/2/3 and FSDP (every rank calls); with torch's hooks."""
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self._sync_groups()
        groups, i = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(i, i + len(g["params"])))
            i += len(g["params"])
            groups.append(packed)
        index_of = {pid: i for pid, (i, _, _) in self._indexed().items()}
        me = type(self).__name__
        state = full_state(self._entries, self._opt, self.dp_model, index_of, self._sharded_state, me)
        part = model_part(self.dp_model, self._indexed())
        return {"state": state, "param_groups": groups, **({} if part is None else {PART: part})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain torch optimizer's ``state_dict()`` (or this one's): the same groups with the
        same number of parameters; each rank keeps the slice it steps. torch's load hooks run around it."""
        load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        me = type(self).__name__
        # first, before any refusal of this rank's own (the per-group sizes of another stage's state
        # differ): the part check is a consensus every rank makes, and names what went wrong
        part = state_dict.get(PART) if isinstance(state_dict, dict) else None
        hint = check_part(part, model_part(self.dp_model, self._indexed()), me, self.agree)
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.param_groups):
            raise StrategyError(
                f"{me}.load_state_dict(): the state dict has "
                f"{len(saved) if isinstance(saved, list) else 'no'} param groups, this optimizer "
                f"{len(self.param_groups)}; build the optimizer with the groups it was saved with"
            )
        sizes = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g.get("params", [])) for g in saved]
        if sizes != theirs:
            raise StrategyError(
                f"{me}.load_state_dict(): parameters per group {theirs} in the state dict, {sizes} here; "
                f"build the optimizer with the groups it was saved with{hint}"
            )
        ids = [pid for g in saved for pid in g["params"]]
        state = state_dict.get("state", {})
        mine: dict[int, Any] = {}
        for i, pid in enumerate(ids):
            st = state.get(pid, state.get(str(pid)))
            if st is not None:
                mine[i] = st
        for g, sg in zip(self.param_groups, saved, strict=True):
            g.update({k: v for k, v in sg.items() if k != "params"})
        self._push_groups()
        load_full_state(self._entries, self._opt, mine, me, not self._sharded_state, hint)

    def _push_groups(self) -> None:
        """This optimizer's group options win over the local optimizer's (after a load)."""
        for g, lg, seen in zip(self.param_groups, self._opt.param_groups, self._seen, strict=True):
            lg.update({k: v for k, v in g.items() if k != "params"})
            seen.clear()
            seen.update({k: v for k, v in g.items() if k != "params"})

    # ------------------------------------------------------------------ norms and consensus
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,  # noqa: ARG002 - torch's argument; the norm is computed per tensor
    ) -> torch.Tensor:
        return clip_by_global_norm(self.dp_model, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """torch's ``clip_grad_value_`` on the synchronized gradients (:func:`clip_by_value`)."""
        clip_by_value(self.dp_model, clip_value)

    def grads_are_finite(self) -> bool:
        return self.agree(all(bool(torch.isfinite(t).all()) for t in self.dp_model.norm_grad_tensors()[0]))

    # ------------------------------------------------------------------ state
    @property
    def _tensors(self) -> list[torch.Tensor]:
        return [e.tensor for e in self._entries]

    @property
    def _names(self) -> list[list[str]]:
        return [[e.name] for e in self._entries]

    @property
    def _pieces(self) -> list[list[Piece]]:
        """The pieces of each entry this rank writes to a checkpoint (default: all of it)."""
        return [[Piece(e.name, e.shape, e.start, e.end, 0)] if e.end > e.start else [] for e in self._entries]

    def sharded_state_dict(self) -> ShardedState:
        self._sync_groups()
        backend = self.dp_model.dp_backend
        state = new_state(self.strategy_name, backend.world_size, backend.rank)
        keys: set[str] = set()
        for t, pieces, names in zip(self._tensors, self._pieces, self._names, strict=True):
            for sk, v in self._opt.state.get(t, {}).items():
                keys.add(sk)
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != t.shape:
                        raise StrategyError(
                            f"{type(self).__name__}: optimizer state {sk!r} has shape {tuple(v.shape)}, not "
                            f"the parameter's {tuple(t.shape)}; only element-wise optimizer state (SGD, "
                            "Adam, ...) can be sharded and resharded. Save opt.state_dict() (whole under "
                            "DDPOptimizer) with torch.save on each rank, and save_checkpoint(..., None)"
                        )
                    flat = v.reshape(-1)
                    for pc in pieces:
                        add_placed_slice(
                            state,
                            f"{pc.name}.{sk}",
                            pc.shape,
                            *self.dp_model.placed(pc.name),
                            v.dtype,
                            pc.start,
                            pc.end,
                            flat[pc.offset : pc.offset + pc.end - pc.start],
                        )
                else:
                    for name in names:
                        add_scalar(state, f"{name}.{sk}", v)
        state.metadata["state_keys"] = sorted(keys)
        state.metadata["param_groups"] = [jsonable(g) for g in self.param_groups]
        state.metadata["param_group_of"] = {e.name: e.group for e in self._entries}
        return state

    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        index = ShardIndex(shards)
        index.alias(self.dp_model.tied_names())  # a copy of a tied weight, saved without a pipeline
        keys = index.extra.get("state_keys")  # absent: a model's shards, which would load as no state
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CheckpointError(
                f"optimizer shard metadata: state_keys={summary(keys)}, expected a list of names (the "
                "shards of opt.sharded_state_dict(); a model's sharded_state_dict() has none)"
            )
        saved = saved_groups(shards, self._entries)  # at pp > 1: this stage's
        if check_groups(saved, self.param_groups, self.agree):
            check_members(shards, self._entries, saved, type(self).__name__, self.agree)
        for t, pieces, names in zip(self._tensors, self._needed_pieces(), self._names, strict=True):
            st: dict[str, Any] = {}
            for sk in keys:
                tensor_keys = [f"{pc.name}.{sk}" for pc in pieces]
                if tensor_keys and all(k in index for k in tensor_keys):
                    buf = torch.zeros(t.numel(), dtype=dtype_from_str(index.meta[tensor_keys[0]][1]))
                    for pc in pieces:
                        buf[pc.offset : pc.offset + pc.end - pc.start] = read_placed(
                            index,
                            f"{pc.name}.{sk}",
                            pc.shape,
                            *self.dp_model.placed(pc.name),
                            pc.start,
                            pc.end,
                        )
                    st[sk] = buf.view(t.shape).to(t.device, t.dtype if buf.is_floating_point() else buf.dtype)
                    continue
                scalar = next(
                    (index.scalars[f"{n}.{sk}"] for n in names if f"{n}.{sk}" in index.scalars), None
                )
                if scalar is not None:
                    st[sk] = (
                        torch.tensor(scalar["value"], dtype=dtype_from_str(scalar["dtype"]))
                        if scalar["dtype"] is not None
                        else scalar["value"]
                    )
                elif any(f"{n}.{sk}" in index for n in names):
                    st[sk] = torch.zeros_like(t)  # this tensor holds only padding of that state
            if st:
                self._opt.state[t] = st
        if saved and len(saved) == len(self.param_groups):
            self._sync_groups()
            for group, values in zip(self.param_groups, saved, strict=True):
                for k, v in values.items():
                    if k in group and k != "params":
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v
                    elif k != "params" and v is not None:  # a scheduler's (initial_lr), as torch's load
                        group[k] = v
            self._push_groups()

    def _needed_pieces(self) -> list[list[Piece]]:
        """The pieces each optimizer tensor must be filled with on load (default: what it saves)."""
        return self._pieces
