"""``new_group`` and ``split`` of :class:`~dtlab.backends.base.CommunicationBackend` (a part of it): argument
checks, checked mode and its inheritance; the engines make the groups (``_new_group``, ``_split``).

The part is generic in the type of group it makes (``base.py`` binds it to ``CommunicationBackend``):
all it needs of a group is :class:`Group`, so it does not import the class it is a part of.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from dtlab.backends._engine import Engine
from dtlab.errors import ArgumentError, integer

__all__ = ["Group", "GroupMaking", "split_members"]


class Group(Protocol):
    """What the part needs of a group it made: checked mode, which the group inherits."""

    @property
    def check_collectives(self) -> bool: ...
    @check_collectives.setter
    def check_collectives(self, on: bool) -> None: ...


G = TypeVar("G", bound=Group)


def split_members(pairs: Sequence[tuple[int | None, int]], color: int) -> list[int]:
    """The ranks that passed ``color`` in a ``split``, ordered by ``(key, rank)`` (its group ranks)."""
    return sorted((r for r, (c, _) in enumerate(pairs) if c == color), key=lambda r: (pairs[r][1], r))


class GroupMaking(Engine, Generic[G]):
    """Sub-groups (of type ``G``); an engine implements ``_new_group`` and may replace the ``_split``
    default."""

    def new_group(self, ranks: Sequence[int]) -> G | None:
        """Called by every rank; members get a backend with ranks renumbered in the given order."""
        given = list(ranks)
        members = [i for i in map(integer, given) if i is not None]  # NumPy's taken; bools refused
        if len(members) != len(given):
            raise ArgumentError(f"new_group: ranks must be ints, got {given}")
        if not members:
            raise ArgumentError("new_group: ranks must not be empty")
        if len(set(members)) != len(members):
            raise ArgumentError(f"new_group: ranks must be distinct, got {members}")
        bad = [r for r in members if not 0 <= r < self.world_size]
        if bad:
            raise ArgumentError(f"new_group: ranks {bad} are outside [0, {self.world_size}) of this backend")
        if self._checked:
            self._agree(("new_group",))
        return self._inherit(self._new_group(members))

    def split(self, color: int | None, key: int = 0) -> G | None:
        """MPI ``Comm_Split``: the ranks that pass the same ``color`` form one group, numbered by
        ``(key, rank)``; ``color=None``: this rank joins no group and gets None.

        Collective: every rank calls it. All groups of one call are made by one exchange of the
        ``(color, key)`` pairs, however many colors there are. Their byte counters also feed this
        backend's (as ``new_group``'s do).
        """
        color, key = self._check_split(color, key)
        if self._checked:
            self._agree(("split",))
        return self._inherit(self._split(color, key))

    def _inherit(self, group: G | None) -> G | None:
        if group is not None:
            group.check_collectives = self._checked
        return group

    # ------------------------------------------------------------------ engine hook and default
    @abstractmethod
    def _new_group(self, ranks: list[int]) -> G | None:
        """This rank's backend in the group of ``ranks`` (ranks of this backend, in the group's order),
        None on a rank outside it; every rank of this backend calls it."""

    def _split(self, color: int | None, key: int) -> G | None:
        """Default: exchange the pairs, then one ``new_group`` per color (engines do better)."""
        pairs, _ = self._all_gather_object((color, key))
        mine: G | None = None
        for c in sorted({c for c, _ in pairs if c is not None}):
            group = self._new_group(split_members(pairs, c))
            if c == color:
                mine = group
        return mine
