"""Gradient compression: sparse all-reduce algorithms (Ok-Topk and its baselines), compressors for
the dense-shaped path, one error-feedback mechanism and per-step statistics.

Use it through :class:`dtlab.optimizers.compression.GradientCompressionOptimizer` (any strategy) or
:class:`GradientSynchronizer` (your own loop).
"""

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from dtlab.compression.base import Compressor, Exchange, NonFiniteGradientError, SparseCompressor
from dtlab.compression.cast import BF16, FP16, Cast
from dtlab.compression.dense import Dense
from dtlab.compression.error_feedback import ErrorFeedback
from dtlab.compression.gaussiank import GaussianK
from dtlab.compression.gtopk import GTopk
from dtlab.compression.oktopk import OkTopk
from dtlab.compression.powersgd import PowerSGD
from dtlab.compression.qsgd import QSGD
from dtlab.compression.randomk import RandomK
from dtlab.compression.reducer import CompressedReducer
from dtlab.compression.synchronizer import GradientSynchronizer
from dtlab.compression.topka import TopK, TopkA
from dtlab.compression.topkdsa import TopkDSA
from dtlab.errors import ConfigError

#: the sparse all-reduce algorithms of the Ok-Topk paper, by name
ALGORITHMS: dict[str, type[Compressor]] = {
    "dense": Dense,
    "topka": TopkA,
    "topkdsa": TopkDSA,
    "gtopk": GTopk,
    "gaussiank": GaussianK,
    "oktopk": OkTopk,
}

#: every compressor by name: the algorithms, then (class, fixed keyword arguments) of the others
COMPRESSORS: Mapping[str, tuple[type[Compressor], Mapping[str, Any]]] = MappingProxyType(
    {
        **{name: (cls, {}) for name, cls in ALGORITHMS.items()},
        "randomk": (RandomK, {}),
        "qsgd": (QSGD, {}),
        "powersgd": (PowerSGD, {}),
        "fp16": (Cast, {"dtype": "float16"}),
        "bf16": (Cast, {"dtype": "bfloat16"}),
    }
)


def make_compressor(name: str, **options: Any) -> Compressor:  # Any: each compressor's own keywords
    """The compressor ``name`` (a key of :data:`COMPRESSORS`) built from the ``options`` it takes;
    options it does not have (``tau`` for ``topka``, ``density`` for ``qsgd``) are ignored, so one set
    of settings can build any of them; an option no compressor has (a typo) is refused."""
    if name not in COMPRESSORS:
        raise ConfigError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")
    known = {f.name for c, _ in COMPRESSORS.values() for f in dataclasses.fields(c)}
    if unknown := sorted(set(options) - known):  # a typo (densty=) is no compressor's option
        raise ConfigError(
            f"make_compressor: no compressor has the options {unknown}; they are {sorted(known)}"
        )
    cls, fixed = COMPRESSORS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**fixed, **{k: v for k, v in options.items() if k in fields and k not in fixed})


__all__ = [
    "ALGORITHMS",
    "BF16",
    "COMPRESSORS",
    "FP16",
    "QSGD",
    "Cast",
    "CompressedReducer",
    "Compressor",
    "Dense",
    "ErrorFeedback",
    "Exchange",
    "GTopk",
    "GaussianK",
    "GradientSynchronizer",
    "NonFiniteGradientError",
    "OkTopk",
    "PowerSGD",
    "RandomK",
    "SparseCompressor",
    "TopK",
    "TopkA",
    "TopkDSA",
    "make_compressor",
]
