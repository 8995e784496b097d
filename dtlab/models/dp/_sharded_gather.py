"""ZeRO-3/FSDP's units between uses: which are gathered, gathering and freeing them, the bytes held.

A unit is gathered by an all-gather into a fresh flat buffer its parameters become views of, and freed
by dropping that buffer: between uses (outside forward and backward) a freed parameter is *parked* at
its logical shape with no memory; inside a forward or backward it is an empty tensor, so an operation
reading it outside its owner's forward fails instead of reading stale values. Saved tensors that alias
a gathered buffer are kept as :class:`SavedRef` references and re-gathered on unpack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.models.dp._sharded_units import SavedRef, ShardUnit
from dtlab.models.dp._sharded_wait import wait_for_every_rank
from dtlab.models.dp.data_parallel import tensor_bytes

__all__ = ["UnitGatherer"]


class UnitGatherer:
    """The units of one sharded strategy, grouped by the module whose forward gathers them."""

    def __init__(self, group: CommunicationBackend, forward_wait_s: float, who: str) -> None:
        self.group = group
        self.forward_wait_s = forward_wait_s
        self.who = who
        self.units: list[ShardUnit] = []
        self.groups: list[list[ShardUnit]] = []
        self.group_modules: list[nn.Module] = []
        self.gathered_bytes = 0
        self.peak = 0
        #: inside a forward or backward: freed parameters are empty tensors, not parked
        self.busy = False
        #: the next gather is an evaluation forward's first: named if a rank does not join in time
        self.watch = False
        self._by_storage: dict[int, ShardUnit] = {}

    def add(self, st: ShardUnit, flat: torch.Tensor | None) -> None:
        """A new unit: kept gathered in ``flat`` when persistent, parked otherwise."""
        if flat is not None:
            st.flat = flat
            st.unit.bind(flat)
            self.gathered_bytes += tensor_bytes(flat)
        else:
            st.unit.park()
        self.units.append(st)

    def gather(self, st: ShardUnit, wait: bool = True) -> None:
        if st.flat is None:
            flat = st.unit.new_flat(zero=False)
            st.work = self.group.iall_gather(flat, st.shard)
            st.flat = flat
            st.unit.bind(flat)
            self._by_storage[flat.untyped_storage().data_ptr()] = st
            self.gathered_bytes += tensor_bytes(flat)
            self.peak = max(self.peak, self.gathered_bytes)
        if wait and st.work is not None:
            if self.watch:
                self.watch = False
                wait_for_every_rank(st.work, self.forward_wait_s, self.who, self.group)
            st.work.wait()
            st.work = None

    def free(self, st: ShardUnit) -> None:
        if st.persistent or st.flat is None:
            return
        if st.work is not None:
            st.work.wait()
            st.work = None
        self._by_storage.pop(st.flat.untyped_storage().data_ptr(), None)
        self.gathered_bytes -= tensor_bytes(st.flat)
        if self.busy:
            st.unit.unbind()
        else:
            st.unit.park()
        st.flat = None

    def gather_group(self, gi: int, wait: bool = True) -> None:
        for st in self.groups[gi]:
            self.gather(st, wait)

    def set_busy(self, busy: bool) -> None:
        """Inside a forward or backward, a parameter not gathered is an empty tensor (an operation
        reading it outside its owner's forward fails); between uses it is parked at its logical
        shape (``numel()``, ``dim()``, ``shape`` as the plain module's, no memory held)."""
        if busy == self.busy:
            return
        self.busy = busy
        for st in self.units:
            if st.flat is None:
                if busy:
                    st.unit.unbind()
                else:
                    st.unit.park()

    def freed(self) -> list[str]:
        """Keys of the units not gathered now."""
        return [st.unit.key for st in self.units if st.flat is None]

    def pack(self, t: torch.Tensor, observe: Callable[[torch.Tensor], Any] | None) -> Any:
        """A saved tensor: a reference when it aliases a gathered buffer, else itself (``observe``d)."""
        st = None if t.numel() == 0 else self._by_storage.get(t.untyped_storage().data_ptr())
        if st is None or st.persistent or st.flat is None or t.dtype != st.flat.dtype:
            if observe is not None:  # kept as it is: the observer counts it
                observe(t)
            return t
        return SavedRef(st.index, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, SavedRef):
            st = self.units[obj.unit]
            self.gather(st)  # normally gathered already by the pre-backward hook
            flat = st.flat
            if flat is None:
                raise RuntimeError(f"unit {st.unit.key} could not be gathered")  # unreachable
            return flat.as_strided(obj.size, obj.stride, obj.offset)
        return cast(torch.Tensor, obj)
