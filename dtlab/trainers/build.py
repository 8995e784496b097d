"""Build the (model strategy, optimizer strategy) pair a config asks for, with real dtlab strategies."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig
from dtlab.core.plan import RunPlan
from dtlab.core.rng import seeded_init
from dtlab.errors import ConfigError
from dtlab.models.base import ModelStrategy
from dtlab.models.precision import MixedPrecisionPolicy
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.parallel_config import run_plan
from dtlab.trainers.construction import (
    Construction,
    largest_module_bytes,
    load_pretrained_weights,
    model_init,
    tensor_bytes,
)
from dtlab.trainers.embedded import Task
from dtlab.trainers.parallel import build_parallel_model

__all__ = [
    "BuiltModel",
    "build_model",
    "build_model_strategy",
    "build_optimizer_strategy",
    "optimizer_record",
    "precision_policy",
    "torch_optimizer",
]


def torch_optimizer(config: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class and the keyword arguments the Trainer builds it with."""
    o = config.optimizer
    if o.name == "sgd":
        # DGC momentum correction: the compressed reducer applies the momentum (checked by the config)
        momentum = 0.0 if config.compression.momentum_correction else o.momentum
        return torch.optim.SGD, {"lr": o.lr, "momentum": momentum, "weight_decay": o.weight_decay}
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls, {"lr": o.lr, "betas": tuple(o.betas), "weight_decay": o.weight_decay}


def optimizer_record(config: TrainConfig) -> dict[str, Any]:
    """What a checkpoint records of its optimizer: the torch class and the hyperparameters it was
    built with (``meta.json``'s ``optimizer``), compared with the config on resume."""
    cls, kwargs = torch_optimizer(config)
    return {"class": cls.__name__, "hyperparameters": {k: plain_value(v) for k, v in kwargs.items()}}


def plain_value(v: Any) -> Any:
    """A hyperparameter as JSON keeps it (tuples as lists), for comparing records."""
    return list(v) if isinstance(v, tuple | list) else v


def _checkpoint(module: torch.nn.Module, strategy: str, task: Task) -> None:
    """Per block of the built-in transformer (the FSDP unit classes), else per FSDP unit (the root)."""
    from dtlab.models.checkpointing import checkpoint_modules

    if task.fsdp_unit_classes:
        checkpoint_modules(module, task.fsdp_unit_classes)
    elif strategy == "fsdp":
        checkpoint_modules(module)  # your model under FSDP is one unit: checkpoint it whole
    else:
        raise ConfigError(
            f"strategy.activation_checkpointing=true: dtlab knows the blocks of the built-in transformer "
            f"and the units of FSDP, not the blocks of {task.name!r} under strategy.model={strategy!r}; "
            "use strategy.model=fsdp, or call dtlab.models.checkpointing.checkpoint_modules(model, "
            "(YourBlock,)) in your model factory"
        )


def precision_policy(config: TrainConfig) -> MixedPrecisionPolicy:
    """``train.precision`` and ``strategy.reduce_dtype`` as one policy (the Trainer's autocast and cast
    of the output; every strategy's gradient reduction reads its ``reduce_dtype``)."""
    return MixedPrecisionPolicy.from_names(config.train.precision, config.strategy.reduce_dtype)


@dataclass(frozen=True)
class BuiltModel:
    """The wrapped model, the module's parameter count, and how it was built (``model.init``)."""

    model: ModelStrategy
    num_parameters: int
    construction: Construction


def _module(
    config: TrainConfig, plan: RunPlan, backend: CommunicationBackend, task: Task
) -> tuple[torch.nn.Module, str]:
    """The freshly built module (on the meta device or plainly, ``model.init``) and how it was built."""
    init = model_init(config, plan)
    with seeded_init(config.train.seed):  # the same initial model on every rank and in every run
        if init == "meta":
            with torch.device("meta"):
                module = task.build_model()
        else:
            module = task.build_model().to(backend.device)
    if init == "meta" and not any(p.is_meta for p in module.parameters()):
        if config.model.init == "meta":
            raise ConfigError(
                f"model.init=meta: the model {type(module).__name__} was built before the run (its "
                "parameters are not on the meta device); pass a function that builds it (model.factory or "
                "Trainer(model=<callable>)) or set model.init=plain"
            )
        return module.to(backend.device), "plain"  # a module object handed to the Trainer: built whole
    return module, init


def build_model(
    config: TrainConfig,
    backend: CommunicationBackend,
    task: Task,
    plan: RunPlan | None = None,
    precision: MixedPrecisionPolicy | None = None,
) -> BuiltModel:
    """The model strategy ``plan`` asks for (default: the config's, on ``backend``'s world) over a
    freshly built module (on the meta device or plainly, ``model.init``) with ``model.pretrained``
    loaded; gradients travel in ``precision``'s ``reduce_dtype`` (default: the config's policy)."""
    from dtlab.models import get_model_strategy

    plan = run_plan(config, backend.world_size) if plan is None else plan
    precision = precision_policy(config) if precision is None else precision
    module, init = _module(config, plan, backend, task)
    whole = tensor_bytes([*module.parameters(), *module.buffers()])
    largest = largest_module_bytes(module)
    n_params = sum(p.numel() for p in module.parameters())
    task = with_fsdp_units(config, module, task)
    kwargs = data_parallel_kwargs(config, plan.data_parallel, task, precision)
    if init == "meta":
        kwargs["init_seed"] = config.train.seed
    if plan.activation_checkpointing and not plan.pipelined:  # a pipeline checkpoints its stages
        _checkpoint(module, plan.data_parallel, task)
    model: ModelStrategy
    if plan.model_parallel:
        model = build_parallel_model(plan, backend, module, kwargs)
    else:
        model = get_model_strategy(plan.data_parallel)(module, backend, **kwargs)
    load_pretrained_weights(config, model)
    share = model.memory_report()["parameters"]
    return BuiltModel(model, n_params, Construction(init, whole, share, largest))


def build_model_strategy(
    config: TrainConfig,
    backend: CommunicationBackend,
    task: Task,
    plan: RunPlan | None = None,
    precision: MixedPrecisionPolicy | None = None,
) -> tuple[ModelStrategy, int]:
    """The model strategy ``plan`` asks for over a freshly built module (``build_model``), and the
    module's parameter count."""
    built = build_model(config, backend, task, plan, precision)
    return built.model, built.num_parameters


def with_fsdp_units(config: TrainConfig, module: torch.nn.Module, task: Task) -> Task:
    """``task`` with ``strategy.fsdp_units`` (class names) resolved to the classes of ``module``'s
    modules (the config refused them where FSDP does not run); refused when a name matches no module."""
    names = config.strategy.fsdp_units
    if names is None:
        return task
    classes = {type(m).__name__: type(m) for m in module.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ConfigError(
            f"strategy.fsdp_units: {missing} name no module class of {type(module).__name__}; its module "
            f"classes are {sorted(classes)}"
        )
    return replace(task, fsdp_unit_classes=tuple(classes[n] for n in names))


def data_parallel_kwargs(
    config: TrainConfig, name: str, task: Task, precision: MixedPrecisionPolicy
) -> dict[str, Any]:
    """The options of data-parallel strategy ``name`` from ``config.strategy`` (and the task's FSDP
    units); gradients are reduced in ``precision.reduce_dtype``."""
    kwargs: dict[str, Any] = {}
    s = config.strategy
    if precision.reduce_dtype is not None:
        kwargs["reduce_dtype"] = precision.reduce_dtype
    if s.find_unused_parameters:
        kwargs["find_unused_parameters"] = True
    if name in ("ddp", "zero1", "zero2"):
        kwargs["bucket_cap_mb"] = s.bucket_cap_mb
    if name == "zero1":
        kwargs["gradient_sync"] = s.gradient_sync
    if name == "zero3":
        kwargs.update(persistence_threshold=s.persistence_threshold, prefetch=s.prefetch)
    if name == "fsdp":
        from dtlab.models.dp.fsdp import ModuleClassPolicy

        kwargs.update(reshard_after_forward=s.reshard_after_forward, prefetch=s.prefetch)
        if task.fsdp_unit_classes:
            kwargs["wrap_policy"] = ModuleClassPolicy(task.fsdp_unit_classes)
    return kwargs


def build_optimizer_strategy(config: TrainConfig, model: ModelStrategy) -> OptimizerStrategy:
    from dtlab.optimizers import get_optimizer_strategy

    torch_cls, kwargs = torch_optimizer(config)
    c = config.compression
    opt: OptimizerStrategy = get_optimizer_strategy(config.strategy.optimizer_name)(
        model, torch_cls, **kwargs
    )
    if c.algorithm == "none":
        return opt
    from dtlab.compression import make_compressor
    from dtlab.optimizers.compression import GradientCompressionOptimizer

    compressor = make_compressor(
        c.algorithm,
        density=c.density,
        tau=c.tau,
        tau_prime=c.tau_prime,
        warmup_steps=c.dense_warmup_steps,
        ramp_steps=c.ramp_steps,
        rank=c.powersgd_rank,
        levels=c.levels,
    )
    # "skip": non-finite gradients come back as NaN so the trainer's guard skips the step on every rank
    mc = config.optimizer.momentum if c.momentum_correction else None
    return GradientCompressionOptimizer(opt, compressor=compressor, nonfinite="skip", momentum_correction=mc)
