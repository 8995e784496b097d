"""The pairing table (dtlab.core.pairs) is the one source the config, registries and classes read."""

from __future__ import annotations

import pytest

import dtlab.models
import dtlab.optimizers
from dtlab.config import load_config
from dtlab.core import pairs
from dtlab.errors import ArgumentError, ConfigError
from dtlab.models import MODEL_STRATEGIES, get_model_strategy
from dtlab.optimizers import OPTIMIZER_STRATEGIES, default_optimizer_strategy, get_optimizer_strategy


def test_table_matches_the_classes() -> None:
    assert tuple(MODEL_STRATEGIES) == pairs.model_names()
    assert tuple(OPTIMIZER_STRATEGIES) == pairs.optimizer_names()
    for name, row in pairs.PAIRINGS.items():
        cls = get_model_strategy(name)
        assert cls is getattr(dtlab.models, row.model_class)
        assert (cls.__name__, cls.strategy_name) == (row.model_class, name)
        assert default_optimizer_strategy(name) is get_optimizer_strategy(row.optimizers[0])
    for name, class_name in pairs.OPTIMIZER_CLASSES.items():
        opt = get_optimizer_strategy(name.upper())
        assert opt is getattr(dtlab.optimizers, class_name)
        assert (opt.__name__, opt.strategy_name) == (class_name, name)
        assert opt.compatible_models == pairs.models_for(name)
    assert pairs.models_for("zero3") == ("zero3", "fsdp", "hybrid")
    assert pairs.default_optimizer("FSDP") == "zero3"


def test_config_reads_the_table() -> None:
    """``strategy.model`` is a data-parallel name of the table (the model-parallel class follows from
    ``parallel.tp``/``parallel.pp``); its optimizers are the table's."""
    for model in pairs.DATA_PARALLEL:
        row = pairs.PAIRINGS[model]
        assert load_config(overrides=[f"strategy.model={model}"]).strategy.optimizer_name == row.optimizers[0]
        for opt in pairs.optimizer_names():
            overrides = [f"strategy.model={model}", f"strategy.optimizer={opt}"]
            if opt in row.optimizers:
                assert load_config(overrides=overrides).strategy.optimizer_name == opt
            else:
                with pytest.raises(ConfigError, match=rf"for '{model}' use strategy.optimizer in"):
                    load_config(overrides=overrides)
    with pytest.raises(ConfigError, match=r"strategy.model='tensorx' is not allowed: .*'ddp', .*'fsdp'"):
        load_config(overrides=["strategy.model=tensorx"])


def test_unknown_names_and_bad_rows() -> None:
    with pytest.raises(ArgumentError, match="unknown model strategy 'zero4'; choose one of ddp, zero1"):
        pairs.pairing("zero4")
    with pytest.raises(ArgumentError, match="unknown optimizer strategy 'lamb'; choose one of ddp"):
        pairs.models_for("lamb")
    with pytest.raises(ArgumentError, match="unknown optimizer strategies"):
        pairs._table(pairs.Pairing("tensor", "TensorParallelModel", ("ddp", "adam")))
    with pytest.raises(ArgumentError, match="repeated"):
        pairs._table(pairs.Pairing("ddp", "DDPModel", ("ddp",)), pairs.Pairing("ddp", "DDPModel", ("ddp",)))
    with pytest.raises(AttributeError):
        pairs.PAIRINGS["ddp"].model = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        pairs.PAIRINGS["x"] = pairs.PAIRINGS["ddp"]  # type: ignore[index]


def test_one_vocabulary_of_data_parallel_names() -> None:
    """The data-parallel names are pairs.DATA_PARALLEL everywhere: the dp axis's strategy classes,
    advise's plans and the benchmarks; each is a model strategy of the pairing table."""
    from typing import get_args

    from dtlab.advise.spec import DP_STRATEGIES, DpStrategy
    from dtlab.benchmarks.mesh import STRATEGIES
    from dtlab.models.compose._build import DATA_PARALLEL_CLASSES

    assert tuple(DATA_PARALLEL_CLASSES) == pairs.DATA_PARALLEL
    assert DP_STRATEGIES == get_args(DpStrategy) == STRATEGIES == pairs.DATA_PARALLEL
    assert all(name in pairs.PAIRINGS for name in pairs.DATA_PARALLEL)
    for name, cls in DATA_PARALLEL_CLASSES.items():
        assert pairs.model_class_name(name) == cls.__name__
