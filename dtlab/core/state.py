"""``ShardedState``: one rank's piece of a model or optimizer state.

It lives in the neutral layer :mod:`dtlab.core` because strategies produce it, checkpoints store it
and compressed reducers add their state to it (docs/architecture.md, section "ShardedState").
``dtlab.models.base`` re-exports it for compatibility.

A state read from a checkpoint holds :class:`LazyTensors`: a mapping whose tensors stay on disk until
used, each read from its verified file (``dtlab.checkpoint``) when it is, so a rank holds only what it
uses. :mod:`dtlab.core.shard_index` reads ranges of them without reading the rest.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dtlab.errors import ArgumentTypeError
from dtlab.untrusted import summary

__all__ = ["LazyTensors", "ShardedState", "TensorSource", "tensor_info", "tensors_where"]


class TensorSource(Protocol):
    """Where :class:`LazyTensors` read from: one file, verified before any of its tensors is read."""

    @property
    def verified(self) -> bool: ...
    def info(self, name: str) -> tuple[list[int], torch.dtype] | None:
        """Shape and dtype of ``name`` (``None``: not in the file); verifies the file first."""
        ...

    def names(self) -> list[str]: ...
    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``name`` flattened (a fresh tensor); verifies the file first."""
        ...


@dataclass(frozen=True)
class _Both:
    """Names both filters accept (picklable, unlike a closure)."""

    first: Callable[[str], bool]
    second: Callable[[str], bool]

    def __call__(self, name: str) -> bool:
        return self.first(name) and self.second(name)


class LazyTensors(MutableMapping[str, torch.Tensor]):
    """A name -> tensor mapping whose tensors stay in ``source`` until used: a tensor read whole
    (``tensors[name]``, iterating its items) is then held like a dict's, so an in-place edit stays and a
    second read reads nothing; :meth:`read` reads a flat range and :meth:`fresh` a whole tensor without
    holding them. ``keep`` hides the names it refuses. ``pickle`` and ``torch.save`` store a dict of its
    tensors (all read); a deep copy stays lazy, reading the same verified file."""

    def __init__(self, source: TensorSource, keep: Callable[[str], bool] | None = None) -> None:
        self.source = source
        self.keep = keep
        self._held: dict[str, torch.Tensor] = {}
        self._gone: set[str] = set()

    def _visible(self, name: str) -> bool:
        return name not in self._gone and (self.keep is None or self.keep(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._held:
            self._held[name] = self.fresh(name)
        return self._held[name]

    def __reduce__(self) -> tuple[type[OrderedDict[str, torch.Tensor]], tuple[list[Any]]]:
        # a state_dict's type, which torch.load(weights_only=True) takes
        return OrderedDict, (list(self.items()),)

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyTensors:
        out = LazyTensors(self.source, self.keep)
        out._held = copy.deepcopy(self._held, memo)
        out._gone = set(self._gone)
        return out

    def fresh(self, name: str) -> torch.Tensor:
        """``self[name]`` read again from the file (or the tensor held), not kept."""
        if name in self._held:
            return self._held[name]
        info = self.source.info(name) if self._visible(name) else None
        if info is None:
            raise KeyError(name)
        shape, _ = info
        numel = 1
        for s in shape:
            numel *= s
        return self.source.read(name, 0, numel).reshape(shape)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._held[name] = value
        self._gone.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._held.pop(name, None)
        self._gone.add(name)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in self._held or (self._visible(name) and self.source.info(name) is not None)

    def __iter__(self) -> Iterator[str]:
        # the file's order, a tensor read or replaced where it was (as in a dict), new names after
        saved = self.source.names()
        names = [n for n in saved if n in self._held or self._visible(n)]
        return iter([*names, *(n for n in self._held if n not in set(saved))])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``name`` flattened, reading only those."""
        if name in self._held:
            return self._held[name].reshape(-1)[start:end]
        if not self._visible(name):
            raise KeyError(name)
        return self.source.read(name, start, end)

    def known(self, name: str) -> tuple[int, torch.dtype] | None:
        """``(elements, dtype)`` of ``name`` without reading the file; ``None`` while its file is not
        verified yet (its entries are checked then) or when it has no such tensor."""
        if name in self._held:
            t = self._held[name]
            return t.numel(), t.dtype
        if not self.source.verified or not self._visible(name):
            return None
        info = self.source.info(name)
        if info is None:
            return None
        numel = 1
        for s in info[0]:
            numel *= s
        return numel, info[1]

    def where(self, keep: Callable[[str], bool]) -> LazyTensors:
        """This mapping restricted to the names ``keep`` accepts (nothing read)."""
        out = LazyTensors(self.source, keep if self.keep is None else _Both(keep, self.keep))
        out._gone = set(self._gone)
        out._held = {n: t for n, t in self._held.items() if keep(n)}
        return out

    def pending(self, name: str) -> bool:
        """Whether ``name`` is to be read from a file not verified yet."""
        return name not in self._held and not self.source.verified


def tensor_info(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, torch.dtype] | None:
    """``(elements, dtype)`` of ``tensors[name]`` without reading it; ``None`` when absent."""
    if isinstance(tensors, LazyTensors):
        return tensors.known(name)
    t = tensors.get(name)
    return None if t is None else (t.numel(), t.dtype)


def tensors_where(
    tensors: Mapping[str, torch.Tensor], keep: Callable[[str], bool]
) -> MutableMapping[str, torch.Tensor]:
    """``tensors`` restricted to the names ``keep`` accepts, without reading lazy ones."""
    if isinstance(tensors, LazyTensors):
        return tensors.where(keep)
    return {k: v for k, v in tensors.items() if keep(k)}


@dataclass
class ShardedState:
    """One rank's piece of a model or optimizer state: tensors plus JSON-serialisable metadata.

    ``metadata`` holds at least ``strategy``, ``world_size`` and ``rank``, and whatever the strategy
    needs to reshard (shapes, shard offsets). A checkpoint stores one per rank; loading receives the
    pieces of *every* saved rank, so it works at another world size (and, through full tensors, under
    another data-parallel strategy). ``tensors`` is a dict, or for a state read from a checkpoint a
    :class:`LazyTensors` whose tensors are read from disk when used.
    """

    tensors: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tensors: object = self.tensors
        if not isinstance(tensors, LazyTensors) and (
            not isinstance(tensors, dict)
            or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items())
        ):
            got = {k: type(v).__name__ for k, v in tensors.items()} if isinstance(tensors, dict) else tensors
            raise ArgumentTypeError(
                f"ShardedState: tensors must be a dict of name -> torch.Tensor (e.g. model.state_dict()'s "
                f"tensors), got {summary(got)}"
            )
        metadata: object = self.metadata
        if not isinstance(metadata, dict):
            raise ArgumentTypeError(
                f"ShardedState: metadata must be a dict of JSON values (e.g. {{}}), got {summary(metadata)}"
            )
