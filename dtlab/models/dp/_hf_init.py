"""A Hugging Face model's own initialization of one module at a time, for a model built on the meta
device (docs/big_models.md).

Hugging Face initializes a model by calling ``_init_weights`` on every module, children before their
parent (``PreTrainedModel.initialize_weights``), and many parents initialize tensors of their children
(GPT-2's attention and MLP redraw their ``c_proj.weight`` scaled by the depth, T5's layers set their
projections' std, Mamba's mixer its convolution and projections). A meta build fills one module's own
tensors at a time, so :class:`HFInit` calls ``_init_weights`` on the module and then on each of its
ancestors that reaches beyond its own tensors (found once, when it is built, by calling it on every
module with the whole model on meta stand-ins), nearest first, with every other tensor under the
highest of them replaced by a meta stand-in marked initialized (Hugging Face's ``_is_hf_initialized``,
which its ``transformers.initialization`` functions skip; other writes and draws on meta do nothing):
the calls reach only this module's tensors, and a parent's init of its children takes effect when
each child is filled. A leaf that no ancestor reaches is initialized by one plain call. The path from
each ancestor to the module is the one the model had when it was built (a tensor plan or a pipeline
may have replaced modules since): it is set back for the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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
        #: by (module id, name): the shape each tensor was built with (a sharding strategy empties its
        #: parameters); the modules stay alive in ``paths``, so their ids are not reused
        self.shapes: dict[tuple[int, str], torch.Size] = {}
        stack: list[tuple[nn.Module, list[_Link], _InitFn]] = [(root, [], root_init)]
        while stack:
            mod, path, init = stack.pop()
            if id(mod) in self.inits:  # a module registered twice: its first path
                continue
            init = _hf_init_of(mod) or init
            self.paths[id(mod)], self.inits[id(mod)] = path, init
            for name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                self.shapes[(id(mod), name)] = t.shape
            for name, child in reversed(list(mod.named_children())):
                stack.append((child, [(mod, name, child), *path], init))
        #: ids of the modules whose ``_init_weights`` reaches beyond their own tensors (called as ancestors)
        self.reaching = self._find_reaching()

    @staticmethod
    def of(root: nn.Module) -> HFInit | None:
        """The initialization of a Hugging Face model (a root with ``_init_weights`` and a ``config``),
        else ``None``."""
        init = _hf_init_of(root)
        return None if init is None else HFInit(root, init)

    def __call__(self, mod: nn.Module) -> None:
        path = self.paths.get(id(mod), [])
        active = [i for i, (ancestor, _, _) in enumerate(path) if id(ancestor) in self.reaching]
        init = self.inits.get(id(mod), self.inits[id(self.root)])
        if not active and not any(True for _ in mod.children()):
            init(mod)  # a leaf no ancestor initializes: its own tensors only
            return
        path = path[: active[-1] + 1] if active else []
        top = path[-1][0] if path else mod  # the highest module called: the others of its tree hide
        own = {id(t) for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]}
        with _on_path(path), self._others_on_meta(top, own):
            init(mod)
            for i in active:
                ancestor = path[i][0]
                self.inits[id(ancestor)](ancestor)

    def _find_reaching(self) -> set[int]:
        """Ids of the modules whose ``_init_weights`` touches a tensor of the model that is not their own,
        found once by calling it on every module with the whole model on (unmarked) meta stand-ins."""
        reaching: set[int] = set()
        mods = list(self.root.modules())
        with self._others_on_meta(self.root, set(), mark=False):
            for mod in mods:
                own = {id(t) for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]}
                seen = _Touched(own)
                try:
                    with seen:
                        self.inits[id(mod)](mod)
                except Exception:  # whatever it does on meta: called as an ancestor, to be safe
                    seen.other = True
                if seen.other:
                    reaching.add(id(mod))
        return reaching

    def _stand_in(self, mod: nn.Module, name: str, t: torch.Tensor, mark: bool) -> torch.Tensor:
        empty = torch.empty(self.shapes.get((id(mod), name), t.shape), dtype=t.dtype, device="meta")
        meta = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
        if mark:
            setattr(meta, _FLAG, True)
        return meta

    @contextmanager
    def _others_on_meta(self, top: nn.Module, own: set[int], mark: bool = True) -> Iterator[None]:
        """Every tensor under ``top`` but those in ``own`` (ids) replaced by a meta stand-in (``mark``:
        marked initialized for Hugging Face)."""
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for mod in top.modules():
                for name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                    if id(t) not in own:
                        setattr(mod, name, self._stand_in(mod, name, t, mark))
                        swapped.append((mod, name, t))
            yield
        finally:
            for mod, name, t in reversed(swapped):
                setattr(mod, name, t)


class _Touched(TorchDispatchMode):
    """Whether an operation ran on a tensor other than those in ``own`` (ids) inside the block."""

    def __init__(self, own: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.own, self.other = own, False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        tensors = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
        if any(id(t) not in self.own and id(getattr(t, "_base", None)) not in self.own for t in tensors):
            self.other = True
        return func(*args, **(kwargs or {}))


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
