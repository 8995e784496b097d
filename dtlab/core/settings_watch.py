"""``SettingsWatch``: whether a model's settings changed since the last look, cheaply enough to ask
before every micro-batch.

The settings are what a model's random draws usually depend on and what dtlab can see without running
it: its modules (one added, removed or replaced), and each module's public number, bool and string
attributes (``training``, so ``train()``/``eval()``; a dropout's ``p``; a stochastic-depth flag of your
own). Attributes starting with ``_`` are left out: a wrapper's bookkeeping between micro-batches
(``no_sync``'s flag, a peak-memory figure) changes every step. Each look compares, per module, the
number of attributes, the values of those settings and the children with a snapshot, in a few C-level
passes over all modules (about 10 us for 100 modules); a change takes a new snapshot, walking the model.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

from torch import nn

from dtlab.core.torch_private import module_children

__all__ = ["SettingsWatch"]

#: the attribute types read as settings
_SETTINGS = (bool, int, float, str)


class SettingsWatch:
    """:meth:`changed`: whether ``model``'s settings changed since the previous call (True at the
    first)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.attrs: list[dict[str, object]] = []  # each module's attributes, live
        self.sizes: list[int] = []
        self.getters: list[Callable[[dict[str, object]], object]] = []
        self.values: list[object] = []
        self.children: list[dict[str, nn.Module | None]] = []  # each module's children, live
        self.kept: list[dict[str, nn.Module | None]] = []  # and as they were

    def changed(self) -> bool:
        try:
            same = (
                bool(self.attrs)
                and list(map(len, self.attrs)) == self.sizes
                and self._values() == self.values
                and self.children == self.kept
            )
        except KeyError:  # an attribute removed and another added: a change
            same = False
        if not same:
            self._snapshot()
        return not same

    def _values(self) -> list[object]:
        return [get(attrs) for get, attrs in zip(self.getters, self.attrs, strict=True)]

    def _snapshot(self) -> None:
        modules = list(self.model.modules())
        self.attrs = [vars(m) for m in modules]
        self.sizes = list(map(len, self.attrs))
        names = [[k for k, v in a.items() if k[0] != "_" and type(v) in _SETTINGS] for a in self.attrs]
        # a module without any (not even "training": no nn.Module.__init__) reads its children's dict
        self.getters = [itemgetter(*(n or ["_modules"])) for n in names]
        self.values = self._values()
        self.children = [module_children(m) for m in modules]
        self.kept = [dict(c) for c in self.children]
