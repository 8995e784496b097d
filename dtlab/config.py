"""``TrainConfig``: every setting of ``dtlab train``, validated before any work starts.

Load with :func:`load_config` from YAML or TOML plus ``key=value`` overrides (values parsed as YAML
scalars: ``2`` is an int, ``1e-3`` a float, ``true`` a bool, ``[1, 2]`` a list). Every invalid value
is one :class:`~dtlab.errors.ConfigError` naming the field by its dotted path (``compression.density``),
the value and what is allowed. Checks that need the world size (global batch divisibility) run in
:func:`check_world_size` as soon as the backend is known, still before any training work.

A config is untrusted input: a file is read up to :data:`MAX_CONFIG_BYTES` and must be UTF-8; a tree
nested deeper than :data:`CONFIG_LIMITS` allows, holding more values once YAML aliases are expanded, or
a longer string is one ``ConfigError`` before any value is used; and an error reports a value by a
bounded summary (:func:`dtlab.untrusted.summary`), never by expanding it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
    model_validator,
)

from dtlab.config_files import CONFIG_LIMITS, check_tree, read_mapping_file
from dtlab.config_sections import (
    COMPRESSORS,
    MODEL_STRATEGIES,
    OPTIMIZER_STRATEGIES,
    RENAMED,
    BackendConfig,
    CheckpointConfig,
    CompressionConfig,
    DataConfig,
    ElasticConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    Section,
    StrategyConfig,
    TrainingConfig,
    translate_old_spellings,
)
from dtlab.errors import ConfigError
from dtlab.untrusted import summary

__all__ = [
    "COMPRESSORS",
    "CONFIG_LIMITS",
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
    "StrategyConfig",
    "TrainConfig",
    "TrainingConfig",
    "apply_overrides",
    "check_tree",
    "check_world_size",
    "load_config",
    "read_mapping_file",
]


class TrainConfig(Section):
    backend: BackendConfig = BackendConfig()
    strategy: StrategyConfig = StrategyConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    compression: CompressionConfig = CompressionConfig()
    parallel: ParallelConfig = ParallelConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    elastic: ElasticConfig = ElasticConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, values: Any) -> Any:  # the tree as parsed, not yet validated
        return translate_old_spellings(values)

    @model_validator(mode="after")
    def _cross(self) -> TrainConfig:
        s = self.strategy
        if (
            s.activation_checkpointing
            and s.model != "fsdp"
            and (self.model.factory or self.model.name != "transformer_lm")
        ):
            raise ValueError(
                "strategy.activation_checkpointing=true checkpoints each block of the built-in transformer "
                "(model.name=transformer_lm) or each FSDP unit (strategy.model=fsdp); for "
                f"{self.model.factory or self.model.name!r} under strategy.model={s.model!r} use "
                "strategy.model=fsdp, or checkpoint in your model factory: "
                "dtlab.models.checkpointing.checkpoint_modules(model, (YourBlock,)), or a Hugging Face "
                "model's own model.gradient_checkpointing_enable()"
            )
        if self.train.precision == "fp16" and self.compression.algorithm != "none":
            raise ValueError(
                f"train.precision=fp16 with compression.algorithm={self.compression.algorithm!r}: the "
                "compressors' error-feedback residuals would mix gradients of different loss scales; use "
                "train.precision=bf16 (no loss scaling) or compression.algorithm=none"
            )
        custom = self.model.factory is not None or self.data.factory is not None
        if not custom and (self.model.name == "digits_cnn") != (self.data.dataset == "digits"):
            raise ValueError(
                f"model.name={self.model.name!r} does not fit data.dataset={self.data.dataset!r}; "
                "use transformer_lm with stdlib or digits_cnn with digits"
            )
        c, o = self.compression, self.optimizer
        if c.momentum_correction and (c.algorithm == "none" or o.name != "sgd" or o.momentum <= 0):
            raise ValueError(
                f"compression.momentum_correction=true moves optimizer.momentum into the compressed "
                f"reducer: it needs compression.algorithm other than 'none' (got {c.algorithm!r}), "
                f"optimizer.name=sgd (got {o.name!r}) and optimizer.momentum > 0 (got {o.momentum}); "
                f"set those or drop momentum_correction"
            )
        if self.elastic.commit_every and self.backend.name == "mpi":
            raise ValueError(
                f"elastic.commit_every={self.elastic.commit_every} does not run on backend.name='mpi': "
                "after a process dies MPI can only shrink the communicator with ULFM, which MPICH's "
                "default build lacks; use gloo/nccl under torchrun elastic or the in-memory backend"
            )
        from dtlab.parallel_config import check_parallel

        check_parallel(self)
        if self.backend.name == "inmemory":
            check_world_size(self, self.backend.world_size)
        if self.optimizer.schedule == "torch":
            from dtlab.lr_schedule import check_torch_scheduler  # imports torch: only when asked

            check_torch_scheduler(self.optimizer, self.train.steps)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def check_world_size(config: TrainConfig, world_size: int) -> None:
    """The run plan on ``world_size`` ranks: the mesh fills the world, the global batch splits evenly
    into dp ranks x ``accumulation_steps`` (and a pipeline's micro-batches); dp is the world size
    without model parallelism."""
    from dtlab.parallel_config import check_mesh_size

    check_mesh_size(config, world_size)


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    section: type[BaseModel] = TrainConfig
    for part in loc:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            break
        section = field.annotation
    return list(section.model_fields)


def _is_section(loc: tuple[int | str, ...]) -> bool:
    """Whether ``loc`` names the whole config or one of its sections (not a field)."""
    section: type[BaseModel] = TrainConfig
    for part in loc:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return False
        section = field.annotation
    return True


def section_fields(section: str) -> list[str]:
    """The field names of config section ``section`` (``train``: ``steps``, ``precision``, ...)."""
    return _fields_at((section,)) if section in TrainConfig.model_fields else []


def settings_named(name: str, cutoff: float | None = None) -> list[str]:
    """``section.name`` for every section with a field called ``name`` (``lr``: ``optimizer.lr``); with
    ``cutoff``, where none has one, those of the field spelled closest (difflib's ratio >= ``cutoff``)."""
    homes = [f"{s}.{name}" for s in TrainConfig.model_fields if name in section_fields(s)]
    if homes or cutoff is None:
        return homes
    every = sorted({f for s in TrainConfig.model_fields for f in section_fields(s)})
    close = difflib.get_close_matches(name, every, n=1, cutoff=cutoff)
    return settings_named(close[0]) if close else []


def _did_you_mean(loc: tuple[int | str, ...], fields: list[str]) -> str:
    """``did you mean X? `` for an unknown field: a close spelling here, or the same name in another
    section (``train.lr`` -> ``optimizer.lr``); empty when nothing is close."""
    name = str(loc[-1])
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}? "
    if len(loc) in (1, 2):  # a field of another section, or a field given without its section
        homes = [h for h in settings_named(name) if h.partition(".")[0] != loc[0]]
        if homes:
            return f"did you mean {' or '.join(homes)}? "
    return ""


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc)
        msg = e["msg"].removeprefix("Value error, ")
        if len(msg) > 2000:
            msg = msg[:2000] + "..."
        value = e.get("input")
        shown = summary(value)
        if e["type"] == "extra_forbidden":
            fields = _fields_at(loc[:-1])
            hint = _did_you_mean(loc, fields)
            lines.append(f"{path}: unknown field (value {shown}); {hint}allowed here: {', '.join(fields)}")
        elif e["type"] == "value_error" and isinstance(value, dict) and _is_section(loc):
            lines.append(msg)  # a section's cross-field check: its message names the fields
        elif e["type"] in ("model_type", "model_attributes_type"):
            fields = _fields_at(loc)
            lines.append(
                f"{path}={shown} is not allowed: {path} is a section, not a value; set its fields, "
                f"e.g. --set {path}.{fields[0]}=...; fields: {', '.join(fields)}"
            )
        else:
            lines.append(f"{path}={shown} is not allowed: {msg}{_value_hint(e['type'], value)}")
    return "invalid configuration: " + "; ".join(lines)


def _value_hint(kind: str, value: Any) -> str:
    """For ``data.max_bytes=1e6``: YAML reads ``1e6`` as a string, and an integer field wants digits;
    for ``strategy.fsdp_units=Block``: a list field wants brackets."""
    if kind == "list_type" and isinstance(value, str):
        return f"; write a list, e.g. [{value}]"
    if kind != "int_parsing" or not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not number.is_integer() or abs(number) > 1e18:
        return ""
    return f"; write it as digits: {int(number)}"


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"override key {dotted!r} is malformed; use section.field=value")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings (values parsed as YAML scalars) to a nested dict, in order."""
    from dtlab.yaml_strict import load_yaml

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(
                f"override {summary(item)} has no '='; write e.g. --set compression.density=0.01"
            )
        if len(item) > CONFIG_LIMITS.string:
            raise ConfigError(
                f"override {summary(item)} is {len(item):,} characters long; at most "
                f"{CONFIG_LIMITS.string:,} are read"
            )
        try:
            value = load_yaml(raw, CONFIG_LIMITS.depth, CONFIG_LIMITS.nodes) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value {raw!r} is not a YAML scalar ({exc})") from None
        if raw.strip().lower() in ("null", "none", "~"):
            value = None
        _set_path(tree, key.strip(), value)
    return tree


def from_dict(tree: dict[str, Any]) -> TrainConfig:
    """Validate a nested dict; any problem is one :class:`ConfigError` naming every bad field."""
    check_tree(tree)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """The embedded default, a YAML/TOML file on top of it, then ``key=value`` overrides."""
    tree: dict[str, Any] = read_mapping_file(path) if path is not None else {}
    if path is not None:
        check_tree(tree, f"config file {str(path)!r}")
    return from_dict(apply_overrides(tree, list(overrides or [])))
