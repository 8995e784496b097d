"""The sections that say how the work is spread over ranks: ``backend`` (the engine and world),
``strategy`` (the data-parallel strategy and its optimizer) and ``parallel`` (the tensor and pipeline
mesh)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtlab.config_sections.base import Section, one_of
from dtlab.config_sections.spellings import accept_old_names, old_model_spelling
from dtlab.core import pairs
from dtlab.core.plan import TpBatchCheckWhen

#: strategy names, from the pairing table (dtlab.core.pairs), in the order messages list them:
#: ``strategy.model`` is the data-parallel strategy over the dp axis (the whole world without a mesh)
MODEL_STRATEGIES = pairs.DATA_PARALLEL
OPTIMIZER_STRATEGIES = pairs.optimizer_names()


class BackendConfig(Section):
    #: ``auto``: a launcher's environment (torchrun, mpiexec) picks gloo/nccl/mpi; none -> in-memory
    name: Literal["auto", "inmemory", "mpi", "gloo", "nccl"] = "auto"
    #: ranks of the in-memory world (threads); under a launcher the launcher decides
    world_size: int = Field(default=4, ge=1, le=64)
    #: seconds any collective may wait before it fails naming the missing ranks (MPI: the watchdog's
    #: time, which ends the job naming the operation)
    timeout: float = Field(default=120.0, gt=0)
    #: real engines: before each collective the ranks compare the call (kind, shape, dtype, op, root)
    #: and a mismatch is a CollectiveMismatchError naming each rank's call (false: the environment
    #: variable DTLAB_CHECK_COLLECTIVES decides; the in-memory world always checks)
    check_collectives: bool = False


class StrategyConfig(Section):
    #: the data-parallel strategy over the dp axis (the whole world without ``parallel.tp``/``pp``):
    #: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``fsdp``; tensor and pipeline parallelism follow from
    #: ``parallel.tp`` and ``parallel.pp`` (``tensor``, ``pipeline``, ``hybrid``: deprecated spellings)
    model: str = "ddp"
    #: optimizer strategy; ``None`` picks the one that fits ``strategy.model``
    optimizer: str | None = None
    #: gradient bucket size in MiB (DDP, ZeRO-1, ZeRO-2; ``DDPModel(bucket_cap_mb=)``, torch DDP's name;
    #: formerly ``bucket_mb``)
    bucket_cap_mb: float = Field(default=25.0, gt=0)
    #: ZeRO-3 keeps parameters with at most this many elements whole on every rank; 0 shards every
    #: parameter. Differs on purpose from ``ZeRO3Model(persistence_threshold=100_000)`` (DeepSpeed's
    #: default, for large models): the embedded models are small, under 100000 nothing would be sharded
    persistence_threshold: int = Field(default=0, ge=0)
    #: FSDP frees units after their forward (``true``: every unit; ``null``, as FSDP2: every unit but
    #: the root, which backward gathers first) or keeps them until their backward (``false``)
    reshard_after_forward: bool | None = None
    #: ZeRO-3/FSDP: all-gather the next unit while the current one computes
    prefetch: bool = True
    #: dtype gradients travel and are summed in (the strategies' ``reduce_dtype``); ``None``: as computed
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    #: recompute activations in backward instead of keeping them (``torch.utils.checkpoint``,
    #: non-reentrant): per block of the built-in transformer, per FSDP unit (``strategy.model=fsdp``)
    activation_checkpointing: bool = False
    #: ZeRO-1: reduce-scatter the gradient buckets (each rank gets the average of its shard,
    #: 2(P-1)/P per step with the parameter all-gather) or all-reduce them (every rank gets the
    #: whole average, 3(P-1)/P)
    gradient_sync: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    #: parameters no rank used in a step (a branch, a task head the loss skips) are left out of the
    #: step, as torch's DDP(find_unused_parameters=True) does, instead of refused (``find_unused_parameters``)
    find_unused_parameters: bool = False
    #: FSDP: the module classes (by class name, e.g. ``["LlamaDecoderLayer"]``) whose instances become
    #: units; ``None``: the built-in model's blocks, a model of your own is one unit
    fsdp_units: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        values = accept_old_names("strategy", values)
        return old_model_spelling(values, None) if isinstance(values, dict) else values

    @field_validator("fsdp_units")
    @classmethod
    def _unit_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"strategy.fsdp_units must be a non-empty list of class names, got {value!r}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _known_model(cls, value: Any) -> Any:
        return one_of(value, MODEL_STRATEGIES)

    @field_validator("optimizer", mode="before")
    @classmethod
    def _known_optimizer(cls, value: Any) -> Any:
        return value if value is None else one_of(value, pairs.optimizer_names())

    @property
    def optimizer_name(self) -> str:
        return self.optimizer or pairs.default_optimizer(self.model)

    @model_validator(mode="after")
    def _fits(self) -> StrategyConfig:
        opt = self.optimizer_name
        fitting = list(pairs.optimizers_for(self.model))
        if opt not in fitting:
            raise ValueError(
                f"strategy.optimizer={opt!r} does not fit strategy.model={self.model!r}; "
                f"for {self.model!r} use strategy.optimizer in {fitting} (or leave it unset)"
            )
        return self


class ParallelConfig(Section):
    """Model parallelism: a mesh of ``pp x dp x tp`` ranks (tp innermost). With ``tp`` or ``pp`` above 1
    the data-parallel ``strategy.model`` runs over each stage's tensor-parallel shards on the dp axis
    (docs/strategies.md, "How to choose a mesh"). Checked before any rank starts
    (``dtlab/parallel_config.py``)."""

    #: data-parallel replicas; ``None``: world size / (tp * pp)
    dp: int | None = Field(default=None, ge=1)
    #: tensor-parallel ranks (attention heads, MLP, vocabulary split; must divide heads and 256)
    tp: int = Field(default=1, ge=1)
    #: pipeline stages (ranks); the transformer's embedding, blocks and head are split among them
    pp: int = Field(default=1, ge=1)
    #: pipeline schedule (``pp > 1``): GPipe, 1F1B, interleaved 1F1B or zero-bubble (ZB-H1)
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    #: micro-batches per step of each pipeline (``None``: pp); at least pp
    micro_batches: int | None = Field(default=None, ge=1)
    #: pipeline stages per rank (``interleaved_1f1b``: at least 2)
    stages_per_rank: int = Field(default=1, ge=1)
    #: where stages 1.. begin: block names (``embed``, ``blocks.0`` .. ``blocks.N-1``, ``head``;
    #: ``None``: balanced by parameter count), or module names of your model (``model.factory``
    #: without ``pipeline_blocks()``, e.g. ``["model.layers.2"]`` for a Hugging Face Llama; required)
    split_points: list[str] | None = None
    #: tensor parallelism splits norm and dropout regions along the sequence (needs tp > 1)
    sequence_parallel: bool = False
    #: the tensor plan (tp > 1): ``auto`` (the plan the model declares: its ``tp_plan()``, Hugging
    #: Face's ``_tp_plan``, dtlab's GPT-2 recipe), a ``.yaml``/``.toml`` file, or a mapping of module
    #: pattern to style, e.g. ``{"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}``
    plan: str | dict[str, str] = "auto"
    #: how often every tp rank's batch is compared with the others' (one small all-reduce each, tp > 1):
    #: ``always`` (every batch), ``first`` (the first ``tp_batch_check_first`` training batches, micro-
    #: batches with accumulation, and as many evaluation batches: catches data sharded by the global
    #: rank), ``never`` (no check, no collective: a data pipeline known to be right)
    tp_batch_check: TpBatchCheckWhen = "always"
    #: with ``tp_batch_check=first``: how many batches are checked
    tp_batch_check_first: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _first_needs_first(self) -> ParallelConfig:
        if self.tp_batch_check_first != 1 and self.tp_batch_check != "first":
            raise ValueError(
                f"parallel.tp_batch_check_first={self.tp_batch_check_first} counts the batches checked with "
                f"parallel.tp_batch_check=first, got parallel.tp_batch_check={self.tp_batch_check}; set "
                "tp_batch_check=first or leave tp_batch_check_first at 1"
            )
        return self

    @field_validator("plan")
    @classmethod
    def _plan(cls, v: str | dict[str, str]) -> str | dict[str, str]:
        if isinstance(v, dict):
            if not v or not all(k and s for k, s in v.items()):
                raise ValueError(f"parallel.plan={v!r}: a mapping of module pattern to style, none empty")
            return v
        if v != "auto" and not v.endswith((".yaml", ".yml", ".toml")):
            raise ValueError(
                f"parallel.plan={v!r}: 'auto' (the model's own plan), a .yaml/.yml/.toml file, or a mapping "
                "{module-pattern: style}"
            )
        return v
