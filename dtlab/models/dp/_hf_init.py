"""A Hugging Face model's own initialization of one module at a time, for a model built on the meta
device (docs/big_models.md).

Hugging Face initializes a model by calling ``_init_weights`` on every module, children before their
parent (``PreTrainedModel.initialize_weights``), and some parents initialize tensors of their children:
GPT-2's ``GPT2Attention`` and ``GPT2MLP`` redraw their ``c_proj.weight`` with the residual-scaled
``initializer_range / sqrt(2 * n_layer)``. A meta build fills one module's own tensors at a time, so
:class:`HFInit` calls ``_init_weights`` on the module and then on each of its ancestors, nearest first,
with every other tensor of the model marked as initialized (Hugging Face's ``_is_hf_initialized``, which
its ``transformers.initialization`` functions skip): the ancestors reach only this module's tensors.
The path from each ancestor to the module is the one the model had when it was built (a tensor plan or
a pipeline may have replaced modules since): it is set back for the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import torch
from torch import nn

__all__ = ["HFInit"]

_FLAG = "_is_hf_initialized"  #: Hugging Face's mark of a tensor its init functions leave alone
_Link = tuple[nn.Module, str, nn.Module]  #: (ancestor, attribute, its child on the path)
_InitFn = Callable[[nn.Module], None]


def _hf_init_of(module: nn.Module) -> _InitFn | None:
    init = getattr(module, "_init_weights", None)
    return init if callable(init) and hasattr(module, "config") else None


class HFInit:
    """``_init_weights`` of the nearest Hugging Face model at or above each module, applied to the module
    and then to its ancestors (see the module docstring). Built from the model as constructed."""

    def __init__(self, root: nn.Module, root_init: _InitFn) -> None:
        self.root = root
        self.paths: dict[int, list[_Link]] = {}  #: by module id: links from the module up to the root
        self.inits: dict[int, _InitFn] = {}  #: by module id: the ``_init_weights`` that initializes it
        stack: list[tuple[nn.Module, list[_Link], _InitFn]] = [(root, [], root_init)]
        while stack:
            mod, path, init = stack.pop()
            if id(mod) in self.inits:  # a module registered twice: its first path
                continue
            init = _hf_init_of(mod) or init
            self.paths[id(mod)], self.inits[id(mod)] = path, init
            for name, child in reversed(list(mod.named_children())):
                stack.append((child, [(mod, name, child), *path], init))

    @staticmethod
    def of(root: nn.Module) -> HFInit | None:
        """The initialization of a Hugging Face model (a root with ``_init_weights`` and a ``config``),
        else ``None``."""
        init = _hf_init_of(root)
        return None if init is None else HFInit(root, init)

    def __call__(self, mod: nn.Module) -> None:
        self.inits.get(id(mod), self.inits[id(self.root)])(mod)
        path = self.paths.get(id(mod), [])
        if not path:
            return
        own = {id(t) for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]}
        with _on_path(path), _others_marked(self.root, own):
            for ancestor, _, _ in path:
                self.inits[id(ancestor)](ancestor)


@contextmanager
def _on_path(path: list[_Link]) -> Iterator[None]:
    """Each ancestor's attribute on ``path`` set back to the child the model was built with."""
    changed: list[tuple[nn.Module, str, nn.Module | None]] = []
    try:
        for ancestor, name, child in path:
            current = getattr(ancestor, name, None)
            if current is not child:
                changed.append((ancestor, name, current if isinstance(current, nn.Module) else None))
                setattr(ancestor, name, child)
        yield
    finally:
        for ancestor, name, current in reversed(changed):
            if current is None:
                with suppress(AttributeError):
                    delattr(ancestor, name)
            else:
                setattr(ancestor, name, current)


@contextmanager
def _others_marked(root: nn.Module, own: set[int]) -> Iterator[None]:
    """Every tensor of ``root`` but those in ``own`` (ids) marked as initialized for Hugging Face."""
    marked: list[torch.Tensor] = []
    try:
        for t in [*root.parameters(), *root.buffers()]:
            if id(t) not in own and not getattr(t, _FLAG, False):
                setattr(t, _FLAG, True)
                marked.append(t)
        yield
    finally:
        for t in marked:
            delattr(t, _FLAG)
