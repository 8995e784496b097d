"""The config's run plan (:class:`~dtlab.core.plan.RunPlan`), built and checked before any rank starts.

:func:`run_plan` turns the ``strategy`` and ``parallel`` sections into the one plan the Trainer, the run
header and ``HybridShardedModel.from_plan`` read; its cross-field checks are the plan's own, with
messages naming the config's fields. :func:`check_parallel` adds what only the config knows (which
model, elastic runs); :func:`check_builtin_fits`, called when a run builds the built-in transformer
(not at config load: the config may be for a model of your own), asks its declaration of its tensor
plan and pipeline blocks (built on the meta device, so nothing here knows its module names);
:func:`check_mesh_size` also needs the world size (the mesh fills the world; the global batch splits
over dp ranks and micro-batches). The section itself is :class:`dtlab.config.ParallelConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from dtlab.core.plan import RunPlan, TpBatchCheck
from dtlab.errors import ArgumentError, ConfigError, StrategyError

if TYPE_CHECKING:
    from torch import nn

    from dtlab.config_sections import DataConfig, ElasticConfig, ModelConfig, ParallelConfig, StrategyConfig

__all__ = [
    "CONFIG_NAMES",
    "PlanSections",
    "builtin_model",
    "check_builtin_fits",
    "check_mesh_size",
    "check_parallel",
    "check_tensor_plan_fits",
    "run_plan",
    "tensor_plan_setting",
]

#: how the plan's fields are spelled in the config (messages name these)
CONFIG_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "data_parallel": "strategy.model",
        "activation_checkpointing": "strategy.activation_checkpointing",
        "pp": "parallel.pp",
        "dp": "parallel.dp",
        "tp": "parallel.tp",
        "tensor_plan": "parallel.plan",
        "sequence_parallel": "parallel.sequence_parallel",
        "schedule": "parallel.schedule",
        "micro_batches": "parallel.micro_batches",
        "stages_per_rank": "parallel.stages_per_rank",
        "split_points": "parallel.split_points",
        "tp_batch_check": "parallel.tp_batch_check",
        "world": "backend.world_size or the launcher",
        "global_batch": "data.global_batch_size",
        "accumulation_steps": "data.accumulation_steps",
    }
)


class PlanSections(Protocol):
    """The sections of a config the run plan reads (a :class:`dtlab.config.TrainConfig` is one; this
    module is below ``dtlab.config``, which checks its plan with it)."""

    @property
    def strategy(self) -> StrategyConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def elastic(self) -> ElasticConfig: ...


def run_plan(config: PlanSections, world_size: int | None = None) -> RunPlan:
    """The config's run plan (every cross-field check made once, a :class:`ConfigError` naming the
    fields); with ``world_size``: resolved on that world and the global batch checked against it."""
    par, s = config.parallel, config.strategy
    try:
        plan = RunPlan(
            data_parallel=s.model,
            pp=par.pp,
            dp=par.dp,
            tp=par.tp,
            tensor_plan=tensor_plan_setting(config),
            sequence_parallel=par.sequence_parallel,
            schedule=par.schedule,
            micro_batches=par.micro_batches,
            stages_per_rank=par.stages_per_rank,
            split_points=None if par.split_points is None else tuple(par.split_points),
            activation_checkpointing=s.activation_checkpointing,
            tp_batch_check=TpBatchCheck(par.tp_batch_check, par.tp_batch_check_first),
            names=CONFIG_NAMES,
        )
        if world_size is None:
            return plan
        plan = plan.resolve(world_size)
        plan.check_batch(config.data.global_batch_size, config.data.accumulation_steps)
    except ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    return plan


def tensor_plan_setting(config: PlanSections) -> str | dict[str, str]:
    """``parallel.plan``: ``"auto"`` or the mapping of module pattern to style (read from the
    ``.yaml``/``.toml`` file it names)."""
    plan = config.parallel.plan
    if isinstance(plan, dict) or plan == "auto":
        return plan
    from dtlab.config_files import read_mapping_file

    try:
        data = read_mapping_file(plan)
    except ConfigError as exc:  # 'config file ... does not exist': name the setting that gave it
        raise ConfigError(f"parallel.plan={plan!r}: {exc}") from None
    bad = {k: v for k, v in data.items() if not (isinstance(k, str) and isinstance(v, str) and k and v)}
    if bad or not data:
        raise ConfigError(
            f"parallel.plan={plan!r}: the file must hold a mapping of module pattern to style name, e.g. "
            f"layers.*.mlp.up: colwise; got {bad or 'an empty mapping'}"
        )
    return data


def _check_tensor_plan(config: PlanSections) -> None:
    """A plan given in the config needs tp > 1, and every style in it is one dtlab honours."""
    par = config.parallel
    if par.plan == "auto":
        return
    if par.tp == 1:
        raise ConfigError(
            f"parallel.plan={par.plan!r} is a tensor plan, but parallel.tp=1; set parallel.tp > 1 or leave "
            "parallel.plan=auto"
        )
    from dtlab.models.tensor._plan import check_style_names

    try:
        setting = tensor_plan_setting(config)
        if isinstance(setting, dict):
            check_style_names(setting)
    except StrategyError as exc:
        raise ConfigError(f"parallel.plan: {exc}") from None


def builtin_model(config: PlanSections) -> nn.Module:
    """``model.name=transformer_lm`` as the config sizes it, on the meta device (no memory, no RNG)."""
    import torch

    from dtlab.zoo import TransformerLM

    m = config.model
    with torch.device("meta"):
        return TransformerLM(m.d_model, m.n_layers, m.n_heads, m.seq_len, m.dropout)


def check_parallel(config: PlanSections) -> None:
    """Everything about the run plan that does not depend on the world size."""
    plan = run_plan(config)
    par, m = config.parallel, config.model
    _check_tensor_plan(config)
    units = config.strategy.fsdp_units
    if units is not None and plan.data_parallel != "fsdp":  # before any rank starts, not on one of them
        raise ConfigError(
            f"strategy.fsdp_units={units} names FSDP units, but the data-parallel strategy is "
            f"{plan.data_parallel!r}; use strategy.model=fsdp or leave strategy.fsdp_units unset"
        )
    if not plan.model_parallel:
        return
    if m.name != "transformer_lm" and m.factory is None:
        raise ConfigError(
            f"parallel.tp={par.tp}, parallel.pp={par.pp}: model parallelism runs the embedded transformer "
            f"(model.name=transformer_lm) or your model (model.factory), not model.name={m.name!r}"
        )
    if config.elastic.commit_every:
        raise ConfigError(
            f"elastic.commit_every={config.elastic.commit_every} with parallel.tp={par.tp}, parallel.pp="
            f"{par.pp}: an elastic world changes size, which a fixed mesh cannot follow; set "
            "elastic.commit_every=0 or train data-parallel only"
        )


def check_builtin_fits(config: PlanSections) -> None:
    """The built-in transformer (``model.name=transformer_lm``) against the run plan, when a run builds
    it: ``model.seq_len`` splits over tp, ``model.n_layers`` over the stages, its tensor plan and
    pipeline blocks fit (``split_points`` name its blocks). Not at config load: the same config may
    train a model of your own (``run_training(model=...)``, ``Trainer(model=...)``), whose blocks and
    sizes are its own."""
    plan = run_plan(config)
    par, m = config.parallel, config.model
    if not plan.model_parallel or m.name != "transformer_lm":
        return
    if par.sequence_parallel and m.seq_len % par.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over parallel.tp={par.tp}, but "
            f"model.seq_len={m.seq_len} is not divisible by {par.tp}; choose a seq_len divisible by {par.tp}"
        )
    if par.pp > 1 and m.n_layers % plan.stages:
        raise ConfigError(
            f"parallel.pp={par.pp} x parallel.stages_per_rank={par.stages_per_rank} = {plan.stages} stages "
            f"do not divide model.n_layers={m.n_layers} (each stage gets the same number of transformer "
            f"blocks, as dtlab advise plans them); use a number of layers divisible by {plan.stages} or "
            "fewer stages"
        )
    check_model_fits(plan, builtin_model(config))


def check_model_fits(plan: RunPlan, module: nn.Module) -> None:
    """The plan against what ``module`` declares: its tensor plan resolves at ``tp`` (whole heads, a
    vocabulary that splits), ``split_points`` name its pipeline blocks."""
    from dtlab.models import HybridShardedModel

    try:
        HybridShardedModel.check_plan(module, plan)
    except ArgumentError as exc:  # the plan's own message, naming the config's fields
        raise ConfigError(str(exc)) from None
    except StrategyError as exc:
        raise ConfigError(
            f"parallel.tp={plan.tp}, parallel.pp={plan.pp} do not fit {type(module).__name__}: {exc}"
        ) from None


def check_tensor_plan_fits(config: PlanSections, module: nn.Module) -> None:
    """Your model (``model.factory``, built once before any rank starts) against the tensor plan:
    every pattern matches, whole heads (grouped-query attention's key/value heads too) and a vocabulary
    that split over ``parallel.tp``; a :class:`ConfigError` naming the module and the sizes."""
    plan = run_plan(config)
    if plan.tp == 1:
        return
    tensor_only = RunPlan(
        plan.data_parallel,
        tp=plan.tp,
        tensor_plan=plan.tensor_plan,
        sequence_parallel=plan.sequence_parallel,
        names=CONFIG_NAMES,
    )
    check_model_fits(tensor_only, module)


def check_mesh_size(config: PlanSections, world_size: int) -> None:
    """The mesh fills the world and the global batch splits over dp ranks (and micro-batches)."""
    run_plan(config, world_size)
