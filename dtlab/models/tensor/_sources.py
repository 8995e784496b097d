"""What a tensor-parallel layer can be split from: the linear layers (``nn.Linear``, Hugging Face's
``Conv1D``) and embeddings, and the subclasses whose own ``forward`` the split layer would not run.

A parallel layer runs a plain ``F.linear`` / ``F.embedding`` on its shard. A subclass that overrides
``forward`` (a scaled embedding, a layer adding its own computation) would silently lose it, so it is
refused (:func:`check_forward`), except Hugging Face's scaled word embeddings (Gemma's, BART's, ...:
``super().forward(input_ids) * self.embed_scale``), whose scale the vocabulary-parallel embedding
applies itself (:func:`embedding_scale`). At each call a split layer checks its weight is still its
shard (:func:`check_shard`) and a row-parallel layer that its input is split (:func:`check_row_input`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn

from dtlab.errors import StrategyError

__all__ = [
    "adapter_hint",
    "built_like",
    "check_forward",
    "check_row_input",
    "check_shard",
    "embedding_scale",
    "linear_features",
]

#: the forwards of Hugging Face's scaled word embeddings, and whether each casts the scale
_SCALED = {
    "super().forward(input_ids) * self.embed_scale": False,
    "super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)": True,
}


def linear_features(module: nn.Module) -> tuple[int, int, bool] | None:
    """``(in_features, out_features, transposed)`` of a linear layer: an ``nn.Linear`` (weight
    ``[out, in]``) or Hugging Face's ``Conv1D`` (GPT-2's: weight ``[in, out]``, ``y = x W + b``, its
    sizes in ``nx`` and ``nf``); ``None`` for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    w, sizes = getattr(module, "weight", None), (getattr(module, "nx", None), getattr(module, "nf", None))
    if type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and tuple(w.shape) == sizes:
        return w.shape[0], w.shape[1], True
    return None


def _returned(cls: type[nn.Module]) -> str | None:
    """The expression ``cls.forward`` returns, where its body is one ``return`` (a docstring aside)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    return ast.unparse(body[0].value)


def embedding_scale(module: nn.Module) -> tuple[torch.Tensor | None, float | None, bool] | None:
    """``(buffer, number, cast)`` of Hugging Face's scaled word embedding (a direct ``nn.Embedding``
    subclass whose forward is the lookup times ``self.embed_scale``: a 0-dim tensor, the buffer, cast to
    the weight's dtype where ``cast``, or a number); ``None`` for anything else."""
    cls = type(module)
    if not isinstance(module, nn.Embedding) or cls.__bases__ != (nn.Embedding,):
        return None
    scale = getattr(module, "embed_scale", None)
    cast = _SCALED.get(_returned(cls) or "")
    if cast is None or not (
        isinstance(scale, float | int) or (isinstance(scale, torch.Tensor) and not scale.dim())
    ):
        return None
    return (scale, None, cast) if isinstance(scale, torch.Tensor) else (None, float(scale), cast)


def check_forward(module: nn.Module, where: str) -> None:
    """Refuse an ``nn.Linear`` / ``nn.Embedding`` subclass with its own ``forward`` (other than Hugging
    Face's scaled word embedding): the split layer would run the plain layer's instead."""
    base = nn.Embedding if isinstance(module, nn.Embedding) else nn.Linear
    if not isinstance(module, base) or type(module).forward is base.forward or embedding_scale(module):
        return
    raise StrategyError(
        f"{where}: {type(module).__name__} overrides {base.__name__}.forward, which the tensor-parallel "
        f"layer replacing it would not run (it computes a plain {base.__name__}'s output on its shard), "
        "silently changing the model; leave this module out of the tensor-parallel plan ('replicate'), "
        "or make it a plain nn.Linear / nn.Embedding with its extra computation outside it"
    )


def check_shard(layer: nn.Module, weight: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Refuse a split layer's ``weight`` resized after the split by code that took it for a plain one."""
    if tuple(weight.shape) != shape:
        raise StrategyError(
            f"{type(layer).__name__}: its weight is {tuple(weight.shape)}, not this rank's shard {shape} of "
            "the layer split over tp (something resized or replaced it after the split, e.g. "
            "resize_token_embeddings on the wrapped module); resize the plain model before wrapping it"
        )


def check_row_input(layer: nn.Module, x: torch.Tensor, local: int) -> None:
    """Refuse a whole input into a row-parallel layer that takes this rank's ``local`` input features."""
    if x.shape[-1] != local:
        raise StrategyError(
            f"{type(layer).__name__} ({layer.extra_repr()}) got an input whose last dim is {x.shape[-1]}, "
            f"not this rank's {local} input features: a row-parallel layer takes the split output of a "
            "column-parallel layer before it (the colwise/rowwise pair of an MLP or an attention). Plan "
            "the layer feeding it 'colwise', or split it 'rowwise_split_input' "
            "(RowwiseParallel(input_is_parallel=False)) to take this rank's slice of a whole input"
        )


def adapter_hint(name: str, module: nn.Module) -> str:
    """For a plan entry ``name`` matching ``module``, not a Linear but holding some (an adapter such as
    LoRA put around the layer the plan meant): how to plan it."""
    held = [n for n, c in module.named_children() if linear_features(c) is not None]
    if not held or linear_features(module) is not None:
        return ""
    return (
        f" (it holds the Linear layers {held}: an adapter such as LoRA put around the layer? Plan, in a "
        f"plan of your own, the layer it wraps under its new name, e.g. '{name}.{held[0]}', and the "
        "adapter's layer beside the split alike: its output layer (LoRA's B) 'colwise' around a 'colwise' "
        "layer, its input layer (LoRA's A) 'rowwise' around a 'rowwise' one; plan='auto' names the layers "
        "as the model was built)"
    )


_Layer = TypeVar("_Layer", bound=nn.Module)


def built_like(cls: Callable[..., _Layer], linear: nn.Module, group: object, **options: Any) -> _Layer:
    """``cls`` (a parallel linear layer) built with ``options`` on the meta device, empty, with the
    sizes, bias and dtype of ``linear`` (an ``nn.Linear`` or a ``Conv1D``, whose ``[in, out]`` layout
    the parallel layer keeps); the caller fills it with this rank's shard."""
    features = linear_features(linear)
    if features is None:
        raise StrategyError(
            f"{getattr(cls, '__name__', cls)} splits an nn.Linear or a Conv1D (weight [in, out]), got "
            f"{type(linear).__name__}"
        )
    in_features, out_features, transposed = features
    return cls(
        in_features,
        out_features,
        group,
        bias=getattr(linear, "bias", None) is not None,
        transposed=transposed,
        device=torch.device("meta"),
        dtype=cast(torch.Tensor, linear.weight).dtype,
        **options,
    )
