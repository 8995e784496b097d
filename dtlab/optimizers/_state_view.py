"""``opt.state`` of an optimizer strategy, torch's way: the local torch optimizer's state, keyed by the
tensors it steps. Under DDP those are the parameters, so ``opt.state[p]`` reads and writes ``p``'s state
as in torch. Under ZeRO-1/2/3 and FSDP they are this rank's pieces of flat shards: ``opt.state[p]`` for
a parameter is refused naming the fix (torch's ``defaultdict`` would hand back an empty dict: a silent
no-op on write, a raw ``KeyError`` on read). ``opt.state = defaultdict(dict)`` (resetting the state)
replaces the local optimizer's state; before, it rebound an attribute the step never reads."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from dtlab.errors import StrategyError

__all__ = ["StateView", "replace_state"]


class StateView(MutableMapping[torch.Tensor, Any]):
    """The local optimizer's state dict (``local.state``), refusing the keys in ``refused`` (ids of
    parameters whose state this rank holds only as pieces) with an error naming ``who``."""

    def __init__(self, local: torch.optim.Optimizer, refused: frozenset[int], who: str) -> None:
        self._local = local
        self._refused = refused
        self._who = who

    def _check(self, key: object) -> None:
        if id(key) in self._refused:
            shape = tuple(key.shape) if isinstance(key, torch.Tensor) else "?"
            raise StrategyError(
                f"{self._who}: opt.state[param] (a parameter of shape {shape}): this rank holds only its "
                "shard of each parameter's optimizer state, keyed by the piece of the flat shard it steps, "
                "so there is no per-parameter entry to read or change. Read the whole state with "
                "opt.state_dict()['state'][index] (collective: every rank calls it; index = the "
                "parameter's position over the param groups), change it with opt.load_state_dict(sd), and "
                "reset it with opt.state.clear() or opt.state = collections.defaultdict(dict)"
            )

    def __getitem__(self, key: torch.Tensor) -> Any:
        self._check(key)
        return self._local.state[key]

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        self._check(key)
        self._local.state[key] = value

    def __delitem__(self, key: torch.Tensor) -> None:
        self._check(key)
        del self._local.state[key]

    def __contains__(self, key: object) -> bool:
        return key in self._local.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._local.state)

    def __len__(self) -> int:
        return len(self._local.state)

    def clear(self) -> None:
        self._local.state.clear()

    def __repr__(self) -> str:
        return repr(self._local.state)


def replace_state(local: torch.optim.Optimizer, new: Any, stepped: list[torch.Tensor], who: str) -> None:
    """``opt.state = new``: the local optimizer's state becomes ``new`` (torch's reset,
    ``defaultdict(dict)``, or a state keyed by the tensors the local optimizer steps, ``stepped``);
    anything else is refused before anything changes."""
    if isinstance(new, StateView):
        return  # opt.state = opt.state
    if not isinstance(new, Mapping):
        raise StrategyError(
            f"{who}: opt.state = {type(new).__name__}; give a mapping (collections.defaultdict(dict) resets "
            "the state), or load a state dict with opt.load_state_dict(sd)"
        )
    mine = {id(t) for t in stepped}
    strangers = [k for k in new if id(k) not in mine]
    if strangers:
        raise StrategyError(
            f"{who}: opt.state = a mapping with {len(strangers)} keys that are not the tensors this rank's "
            "optimizer steps (under ZeRO-1/2/3 and FSDP those are pieces of flat shards, not the "
            "parameters); reset the state with opt.state = collections.defaultdict(dict), or load a state "
            "dict with opt.load_state_dict(sd)"
        )
    state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    state.update(new)
    local.state = state
