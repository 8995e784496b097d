"""ZeRO-3/FSDP's hooks: each group of units gathered by its module's forward pre-hook and freed by its
forward hook (``reshard_after_forward``), gathered again before its gradients are computed (a hook on
the module's outputs), and the neighbouring group in forward order prefetched with a non-blocking
all-gather (the next one in forward, the previous one in backward)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtlab.models.dp._sharded_gather import UnitGatherer

__all__ = ["GroupHooks"]


def _identity(fn: Any) -> Any:
    return fn


class GroupHooks:
    """The gather/free hooks of every group of ``at_rest``; ``begin_backward`` runs before a group's
    gradients are computed."""

    def __init__(
        self,
        at_rest: UnitGatherer,
        begin_backward: Callable[[], None],
        reshard_after_forward: bool,
        prefetch: bool,
    ) -> None:
        self.at_rest = at_rest
        self.begin_backward = begin_backward
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        #: the groups in the order the first forward ran them (prefetching follows it from then on)
        self.order: list[int] = []
        self.order_done = False
        self.for_compile = False
        self._handles: list[Any] = []
        self.install()

    def install(self) -> None:
        """(Re)install the hooks; once ``torch.compile`` is loaded, each runs eagerly (a graph break):
        they talk to the backend and swap parameter storage, which a compiled graph cannot do."""
        self.remove()
        self.for_compile = "torch._dynamo" in sys.modules
        wrap: Callable[[Any], Any] = torch.compiler.disable if self.for_compile else _identity
        for gi, gmod in enumerate(self.at_rest.group_modules):
            self._handles.append(gmod.register_forward_pre_hook(wrap(self._pre_forward(gi))))
            self._handles.append(gmod.register_forward_hook(wrap(self._post_forward(gi))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def before_forward(self) -> None:
        """A forward starts: reinstall the hooks for ``torch.compile`` if it was loaded after wrapping."""
        if not self.for_compile and "torch._dynamo" in sys.modules:
            torch.compiler.disable(self.install)()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self.remove()
        try:
            yield
        finally:
            self.install()

    def _neighbour(self, gi: int, step: int) -> int | None:
        if not self.prefetch or gi not in self.order:
            return None
        pos = self.order.index(gi) + step
        return self.order[pos] if 0 <= pos < len(self.order) else None

    def _pre_forward(self, gi: int) -> Any:
        def pre_forward(_module: nn.Module, _args: Any) -> None:
            if not self.order_done and gi not in self.order:
                self.order.append(gi)
            self.at_rest.gather_group(gi)
            nxt = self._neighbour(gi, +1)
            if nxt is not None and self.order_done:
                self.at_rest.gather_group(nxt, wait=False)

        return pre_forward

    def _post_forward(self, gi: int) -> Any:
        def post_forward(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward(gi))
            if self.reshard_after_forward or not torch.is_grad_enabled():  # no backward will free it
                for st in self.at_rest.groups[gi]:
                    self.at_rest.free(st)

        return post_forward

    def _pre_backward(self, gi: int) -> Any:
        def pre_backward(_grad: torch.Tensor) -> None:
            self.begin_backward()
            self.at_rest.gather_group(gi)
            prev = self._neighbour(gi, -1)
            if prev is not None and self.reshard_after_forward:
                self.at_rest.gather_group(prev, wait=False)

        return pre_backward
