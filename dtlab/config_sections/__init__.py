"""The sections of :class:`dtlab.config.TrainConfig`, each a frozen pydantic model that checks its own
fields, one module per area:

- :mod:`~dtlab.config_sections.parallelism`: ``backend``, ``strategy``, ``parallel``
- :mod:`~dtlab.config_sections.optimizer`: ``optimizer``
- :mod:`~dtlab.config_sections.compression`: ``compression``
- :mod:`~dtlab.config_sections.model_data`: ``model``, ``data``
- :mod:`~dtlab.config_sections.training`: ``train``
- :mod:`~dtlab.config_sections.checkpoint`: ``checkpoint``, ``elastic``
- :mod:`~dtlab.config_sections.logs`: ``logging``

:mod:`~dtlab.config_sections.base` holds what they share, :mod:`~dtlab.config_sections.spellings` the old
names still read. Checks across sections, loading and error messages are in :mod:`dtlab.config`, which
re-exports every class here.
"""

from __future__ import annotations

from dtlab.config_sections.base import Section
from dtlab.config_sections.checkpoint import CheckpointConfig, ElasticConfig
from dtlab.config_sections.compression import COMPRESSORS, CompressionConfig
from dtlab.config_sections.logs import LoggingConfig
from dtlab.config_sections.model_data import DataConfig, ModelConfig
from dtlab.config_sections.optimizer import OptimizerConfig
from dtlab.config_sections.parallelism import (
    MODEL_STRATEGIES,
    OPTIMIZER_STRATEGIES,
    BackendConfig,
    ParallelConfig,
    StrategyConfig,
)
from dtlab.config_sections.spellings import RENAMED, translate_old_spellings
from dtlab.config_sections.training import TrainingConfig

__all__ = [
    "COMPRESSORS",
    "MODEL_STRATEGIES",
    "OPTIMIZER_STRATEGIES",
    "RENAMED",
    "BackendConfig",
    "CheckpointConfig",
    "CompressionConfig",
    "DataConfig",
    "ElasticConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "Section",
    "StrategyConfig",
    "TrainingConfig",
    "translate_old_spellings",
]
