"""``new_group`` and ``split`` of :class:`~dtlab.backends.base.CommunicationBackend` (a mixin): argument
checks, checked mode and its inheritance; the engines make the groups (``_new_group``, ``_split``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtlab.backends._checked import CheckState
from dtlab.errors import ArgumentError

if TYPE_CHECKING:
    from dtlab.backends.base import CommunicationBackend

__all__ = ["GroupMaking", "split_members"]


def split_members(pairs: Sequence[tuple[int | None, int]], color: int) -> list[int]:
    """The ranks that passed ``color`` in a ``split``, ordered by ``(key, rank)`` (its group ranks)."""
    return sorted((r for r, (c, _) in enumerate(pairs) if c == color), key=lambda r: (pairs[r][1], r))


class GroupMaking:
    """Sub-groups; an engine implements ``_new_group`` and may replace the ``_split`` default."""

    _checked: bool
    _check_state: CheckState | None

    if TYPE_CHECKING:  # provided by CommunicationBackend

        @property
        def rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def device(self) -> torch.device: ...

        def _check_split(self, color: object, key: object) -> None: ...

        def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

        def _agree(self, call: tuple[Any, ...]) -> None: ...

        def _all_gather_object(self, obj: Any) -> tuple[list[Any], list[int]]: ...

        def _new_group(self, ranks: list[int]) -> CommunicationBackend | None: ...

    def new_group(self, ranks: Sequence[int]) -> CommunicationBackend | None:
        """Called by every rank; members get a backend with ranks renumbered in the given order."""
        members = [int(r) for r in ranks]
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

    def split(self, color: int | None, key: int = 0) -> CommunicationBackend | None:
        """MPI ``Comm_Split``: the ranks that pass the same ``color`` form one group, numbered by
        ``(key, rank)``; ``color=None``: this rank joins no group and gets None.

        Collective: every rank calls it. All groups of one call are made by one exchange of the
        ``(color, key)`` pairs, however many colors there are. Their byte counters also feed this
        backend's (as ``new_group``'s do).
        """
        self._check_split(color, key)
        if self._checked:
            self._agree(("split",))
        return self._inherit(self._split(color, key))

    def _inherit(self, group: CommunicationBackend | None) -> CommunicationBackend | None:
        if group is not None:
            group.check_collectives = self._checked
        return group

    # ------------------------------------------------------------------ engine default
    def _split(self, color: int | None, key: int) -> CommunicationBackend | None:
        """Default: exchange the pairs, then one ``new_group`` per color (engines do better)."""
        pairs, _ = self._all_gather_object((color, key))
        mine: CommunicationBackend | None = None
        for c in sorted({c for c, _ in pairs if c is not None}):
            group = self._new_group(split_members(pairs, c))
            if c == color:
                mine = group
        return mine
