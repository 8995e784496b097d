"""Gradient compression: sparse all-reduce algorithms (Ok-Topk and its baselines), compressors for
the dense-shaped path, one error-feedback mechanism and per-step statistics.

Use it through :class:`dtlab.optimizers.compression.GradientCompressionOptimizer` (any strategy) or
:class:`GradientSynchronizer` (your own loop).
"""

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

#: the sparse all-reduce algorithms of the Ok-Topk paper, by name
ALGORITHMS: dict[str, type[Compressor]] = {
    "dense": Dense,
    "topka": TopkA,
    "topkdsa": TopkDSA,
    "gtopk": GTopk,
    "gaussiank": GaussianK,
    "oktopk": OkTopk,
}

__all__ = [
    "ALGORITHMS",
    "BF16",
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
]
