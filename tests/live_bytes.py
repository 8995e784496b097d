"""Live bytes of tensor storage, counted per thread by a ``TorchDispatchMode``.

In-memory ranks are threads and a dispatch mode is per thread, so each rank counts its own. Counted:
the storages an operation allocates (not views or in-place results of its inputs, not meta tensors)
of ``MIN_BYTES`` or more, from when the operation returns them until torch frees them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIN_BYTES = 64


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages this thread's operations allocate (``now``), and their ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.now = 0
        self.peak = 0

    def _gone(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            key, size = st.data_ptr(), st.nbytes()
            if size >= MIN_BYTES and key not in inputs and key not in self.live:
                self.live[key] = size
                self.refs[key] = weakref.ref(st, lambda _r, key=key: self._gone(key))
                self.now += size
                self.peak = max(self.peak, self.now)
        return out
