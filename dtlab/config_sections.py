"""The sections of :class:`dtlab.config.TrainConfig` (``backend``, ``strategy``, ``parallel``,
``optimizer``, ``compression``, ``model``, ``data``, ``train``, ``checkpoint``, ``elastic``,
``logging``): each a frozen pydantic model that checks its own fields. Checks across sections, loading
and error messages are in :mod:`dtlab.config`, which re-exports every class here.
"""

from __future__ import annotations

import math
import warnings
from types import MappingProxyType
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dtlab.core import pairs

#: strategy names, from the pairing table (dtlab.core.pairs), in the order messages list them:
#: ``strategy.model`` is the data-parallel strategy over the dp axis (the whole world without a mesh)
MODEL_STRATEGIES = pairs.DATA_PARALLEL
OPTIMIZER_STRATEGIES = pairs.optimizer_names()
COMPRESSORS = ("none", "dense", "topka", "topkdsa", "gtopk", "gaussiank", "oktopk")


def _one_of(value: Any, allowed: tuple[str, ...]) -> Any:
    """A choice from a table that grows (the pairing table) rather than a fixed ``Literal``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Input should be one of {', '.join(repr(a) for a in allowed)}")
    return value


#: (section, old field name) -> new name: the old names are still read, with a FutureWarning
RENAMED: MappingProxyType[tuple[str, str], str] = MappingProxyType(
    {
        ("strategy", "bucket_mb"): "bucket_cap_mb",
        ("compression", "warmup_steps"): "dense_warmup_steps",
        ("compression", "rank"): "powersgd_rank",
    }
)


def _accept_old_names(section: str, values: Any) -> Any:
    if not isinstance(values, dict):
        return values
    out = dict(values)
    for (sec, old), new in RENAMED.items():
        if sec != section or old not in out:
            continue
        if new in out:
            raise ValueError(
                f"{section}.{old} is the old name of {section}.{new}; both are set: keep only {section}.{new}"
            )
        out[new] = out.pop(old)
        warnings.warn(
            f"{section}.{old} is deprecated: it is now {section}.{new} (the old name still works for now)",
            FutureWarning,
            stacklevel=2,
        )
    return out


def _old_model_spelling(strategy: dict[str, Any], parallel: Any) -> dict[str, Any]:
    """``strategy.model`` tensor, pipeline or hybrid (the old spellings, when it also named the
    model-parallel class) as the data-parallel strategy they ran on the dp axis: the optimizer's
    (``ddp`` unless ``strategy.optimizer`` says otherwise), with a FutureWarning naming the new spelling.
    ``parallel``: the raw ``parallel`` section when known (tensor kept pp = 1, pipeline tp = 1)."""
    old = strategy.get("model")
    if not isinstance(old, str) or old.lower() not in pairs.MODEL_PARALLEL:
        return strategy
    old = old.lower()
    par = parallel if isinstance(parallel, dict) else {}
    other = {
        "tensor": ("pp", "dp x tp", "pipeline stages"),
        "pipeline": ("tp", "pp x dp", "tensor parallelism"),
    }
    if old in other:
        axis, mesh, what = other[old]
        size = par.get(axis, 1)
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            raise ValueError(
                f"strategy.model={old!r} runs on the {mesh} mesh, but parallel.{axis}={size}; use "
                f"strategy.model=hybrid (or a data-parallel strategy such as ddp) for {what} too"
            )
    optimizer = strategy.get("optimizer")
    new = optimizer.lower() if isinstance(optimizer, str) else "ddp"
    new = new if new in pairs.DATA_PARALLEL else "ddp"
    warnings.warn(
        f"strategy.model={old!r} is deprecated: strategy.model names the data-parallel strategy over the "
        f"dp axis ({', '.join(pairs.DATA_PARALLEL)}) and the model-parallel layout follows from "
        f"parallel.tp / parallel.pp; write strategy.model={new} (the old spelling still works for now)",
        FutureWarning,
        stacklevel=2,
    )
    return {**strategy, "model": new}


def translate_old_spellings(tree: Any) -> Any:
    """A whole config tree with ``strategy.model``'s old spellings translated (see above)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("strategy"), dict):
        return tree
    return {**tree, "strategy": _old_model_spelling(tree["strategy"], tree.get("parallel"))}


class _Section(BaseModel):
    # allow_inf_nan=False: no setting is meaningful at infinity or NaN (an infinite lr or timeout)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """Strict numbers: pydantic would take ``true`` for 1 (``--set train.steps=true``)."""
        if isinstance(v, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            types = set(get_args(annotation)) or {annotation}
            if types & {int, float} and bool not in types:
                kind = "an integer" if int in types else "a number"
                raise ValueError(f"a bool is not a number here; give {kind}")
        return v


class BackendConfig(_Section):
    #: ``auto``: a launcher's environment (torchrun, mpiexec) picks gloo/nccl/mpi; none -> in-memory
    name: Literal["auto", "inmemory", "mpi", "gloo", "nccl"] = "auto"
    #: ranks of the in-memory world (threads); under a launcher the launcher decides
    world_size: int = Field(default=4, ge=1, le=64)
    #: seconds any collective may wait before it fails naming the missing ranks
    timeout: float = Field(default=120.0, gt=0)
    #: real engines: before each collective the ranks compare the call (kind, shape, dtype, op, root)
    #: and a mismatch is a CollectiveMismatchError naming each rank's call (false: the environment
    #: variable DTLAB_CHECK_COLLECTIVES decides; the in-memory world always checks)
    check_collectives: bool = False


class StrategyConfig(_Section):
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
    #: FSDP frees each unit after its forward (least memory) or keeps it until its backward
    reshard_after_forward: bool = True
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
    #: FSDP: the module classes (by class name, e.g. ``["LlamaDecoderLayer"]``) whose instances become
    #: units; ``None``: the built-in model's blocks, a model of your own is one unit
    fsdp_units: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        values = _accept_old_names("strategy", values)
        return _old_model_spelling(values, None) if isinstance(values, dict) else values

    @field_validator("fsdp_units")
    @classmethod
    def _unit_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"strategy.fsdp_units must be a non-empty list of class names, got {value!r}")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _known_model(cls, value: Any) -> Any:
        return _one_of(value, MODEL_STRATEGIES)

    @field_validator("optimizer", mode="before")
    @classmethod
    def _known_optimizer(cls, value: Any) -> Any:
        return value if value is None else _one_of(value, pairs.optimizer_names())

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


class ParallelConfig(_Section):
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


class OptimizerConfig(_Section):
    #: the torch optimizer each rank runs on its parameters (or shards): AdamW, Adam or SGD
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    #: peak learning rate (after warm-up)
    lr: float = Field(default=4e-3, gt=0)
    #: decoupled weight decay (AdamW) or L2 penalty (Adam, SGD)
    weight_decay: float = Field(default=0.01, ge=0)
    #: SGD momentum (``optimizer.name=sgd``)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    #: Adam/AdamW coefficients of the running averages of the gradient and its square
    betas: tuple[float, float] = (0.9, 0.99)
    #: learning-rate schedule after warm-up: cosine to ``min_lr_ratio * lr``, step decay, or constant;
    #: ``torch``: the ``torch.optim.lr_scheduler`` class ``torch_scheduler`` (no added warm-up)
    schedule: Literal["cosine", "step", "constant", "torch"] = "cosine"
    #: linear learning-rate warm-up from 0 over this many steps
    warmup_steps: int = Field(default=10, ge=0)
    #: ``schedule=cosine``: the final learning rate as a fraction of ``lr``
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    #: ``schedule=step``: steps between decays
    step_size: int = Field(default=100, ge=1)
    #: ``schedule=step``: factor of each decay
    gamma: float = Field(default=0.5, gt=0, le=1)
    #: clip gradients by their global norm over all ranks' shards; ``None`` disables clipping
    clip_grad_norm: float | None = Field(default=1.0, gt=0)
    #: ``schedule=torch``: a ``torch.optim.lr_scheduler`` class by name, e.g. ``OneCycleLR``
    torch_scheduler: str | None = None
    #: ``schedule=torch``: its keyword arguments (``total_steps``/``T_max``/``total_iters``: train.steps)
    torch_scheduler_args: dict[str, float | int | bool | str | list[float] | list[int]] = Field(
        default_factory=dict
    )

    @model_validator(mode="after")
    def _torch_schedule(self) -> OptimizerConfig:
        if self.schedule != "torch" and self.torch_scheduler is not None:
            raise ValueError(
                f"optimizer.torch_scheduler={self.torch_scheduler!r} needs optimizer.schedule=torch "
                f"(it is {self.schedule!r})"
            )
        if self.schedule != "torch" and self.torch_scheduler_args:
            raise ValueError(
                f"optimizer.torch_scheduler_args={dict(self.torch_scheduler_args)!r} would be ignored: "
                f"they apply to optimizer.schedule=torch only (it is {self.schedule!r}); set "
                "optimizer.schedule=torch and optimizer.torch_scheduler, or drop them"
            )
        if self.schedule == "torch":
            if self.torch_scheduler is None:
                raise ValueError(
                    "optimizer.schedule='torch' needs optimizer.torch_scheduler, e.g. OneCycleLR"
                )
            if "warmup_steps" in self.model_fields_set and self.warmup_steps:
                raise ValueError(
                    f"optimizer.warmup_steps={self.warmup_steps} does not apply to "
                    "optimizer.schedule='torch'; use the scheduler's own warm-up (e.g. OneCycleLR's "
                    "pct_start) and leave optimizer.warmup_steps unset"
                )
        return self

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must lie in [0, 1), e.g. [0.9, 0.99]")
        return v


class CompressionConfig(_Section):
    #: ``none`` (uncompressed); a sparse all-reduce of the Ok-Topk paper (``dense`` is its baseline
    #: through the compressed path); or a compressor: ``randomk``, ``qsgd``, ``powersgd``, ``fp16``, ``bf16``
    algorithm: Literal[
        "none",
        "dense",
        "topka",
        "topkdsa",
        "gtopk",
        "gaussiank",
        "oktopk",
        "randomk",
        "qsgd",
        "powersgd",
        "fp16",
        "bf16",
    ] = "none"
    #: fraction of gradient values each step sends, in (0, 1] (the sparse algorithms and random-k)
    density: float = 0.01
    #: Ok-Topk: re-evaluate the local and global thresholds every ``tau`` steps
    tau: int = Field(default=32, ge=1)
    #: Ok-Topk: rebalance the region boundaries every ``tau_prime`` steps
    tau_prime: int = Field(default=64, ge=1)
    #: dense steps before compression starts (formerly ``compression.warmup_steps``; not the LR warm-up
    #: ``optimizer.warmup_steps``). Short for short runs: the Python classes default to 128 for
    #: ``OkTopk`` (the paper's) and 10 for ``PowerSGD``, 0 for the others
    dense_warmup_steps: int = Field(default=10, ge=0)
    #: sparse algorithms and random-k: after the warm-up, steps over which the density falls from 25%
    #: to ``density`` in 4x stages (Deep Gradient Compression's warm-up training); 0: none
    ramp_steps: int = Field(default=0, ge=0)
    #: DGC momentum correction: ``optimizer.momentum`` is applied in the compressed reducer (before
    #: selection, with momentum factor masking) instead of by the optimizer; needs ``optimizer.name=sgd``
    momentum_correction: bool = False
    #: PowerSGD: rank of the low-rank approximation (``PowerSGD(rank=)``; formerly ``compression.rank``,
    #: which read like a process rank)
    powersgd_rank: int = Field(default=4, ge=1)
    #: QSGD: quantization levels per sign (int8 codes: at most 127)
    levels: int = Field(default=127, ge=1, le=127)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        return _accept_old_names("compression", values)

    @field_validator("density")
    @classmethod
    def _density(cls, v: float) -> float:
        if math.isnan(v) or not 0.0 < v <= 1.0:
            raise ValueError("allowed range is (0, 1], e.g. 0.01 sends 1% of the gradient values")
        return v


def _check_reference(value: str | None, field: str) -> str | None:
    """``pkg.mod:fn`` (the shape only; importing it is checked before any rank starts)."""
    if value is None:
        return None
    mod, sep, fn = value.partition(":")
    if not sep or not mod or not fn or not all(p.isidentifier() for p in [*mod.split("."), *fn.split(".")]):
        raise ValueError(f"{field} must look like package.module:function, got {value!r}")
    return value


class ModelConfig(_Section):
    #: ``transformer_lm``: byte-level causal transformer; ``digits_cnn``: small CNN for 8x8 digits
    name: Literal["transformer_lm", "digits_cnn"] = "transformer_lm"
    #: your own model: ``package.module:function`` called with no arguments, returning an ``nn.Module``
    #: (replaces ``model.name``)
    factory: str | None = None
    #: ``cross_entropy``, ``mse`` or ``package.module:function`` of ``(output, target)`` returning a
    #: scalar; ``None``: the built-in task's loss (cross entropy)
    loss: str | None = None
    #: transformer width (embedding and residual stream)
    d_model: int = Field(default=128, ge=8)
    #: transformer blocks
    n_layers: int = Field(default=2, ge=1)
    #: attention heads per block (must divide ``d_model``)
    n_heads: int = Field(default=4, ge=1)
    #: tokens per sample (the built-in model's position table has one row per token)
    seq_len: int = Field(default=64, ge=2, le=1 << 20)
    #: dropout probability in the blocks (keep 0 with tensor parallelism on in-memory ranks)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    #: how the model is built (default ``None``: ``meta`` where the strategy shards the model, ``plain``
    #: where every rank holds it whole: DDP, ZeRO-1/2); ``meta``: on the meta device (shapes only), each
    #: rank materializing and initializing only its own part, one module whole at a time (ZeRO-3, FSDP,
    #: tensor, pipeline and hybrid parallelism); ``plain``: whole on every rank, then wrapped
    init: Literal["meta", "plain"] | None = None
    #: pretrained weights loaded after the model is built (before a resume, which replaces them): a
    #: safetensors file, a folder with ``model.safetensors`` or a sharded ``model.safetensors.index.json``
    #: (what Hugging Face's ``save_pretrained`` writes), or the file ``dtlab consolidate`` writes; keys
    #: are the module's ``state_dict()`` keys, all must match; each rank reads only its part
    pretrained: str | None = None

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        return _check_reference(v, "model.factory")

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str | None) -> str | None:
        return v if v in (None, "cross_entropy", "mse") else _check_reference(v, "model.loss")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "pick model.n_heads dividing model.d_model"
            )
        return self


class DataConfig(_Section):
    #: ``stdlib``: the Python standard library's own source files; ``digits``: scikit-learn's digits
    dataset: Literal["stdlib", "digits"] = "stdlib"
    #: your own data: ``package.module:function`` called with no arguments, returning a map-style torch
    #: ``Dataset`` of ``(input, target)`` pairs (the last ``eval_fraction`` is held out) or a
    #: ``(train, eval)`` pair of them (replaces ``data.dataset``)
    factory: str | None = None
    #: ``DataLoader`` worker processes per rank (0: load in the training thread)
    num_workers: int = Field(default=0, ge=0)
    #: ``DataLoader(pin_memory=...)``: page-locked host batches for faster copies to a GPU
    pin_memory: bool = False
    #: bytes of the stdlib corpus to read (a deterministic subset of files, sorted by path)
    max_bytes: int = Field(default=1_000_000, ge=10_000)
    #: samples per optimizer step over all data-parallel ranks (ranks x accumulation steps x micro-batch)
    global_batch_size: int = Field(default=32, ge=1)
    #: micro-batches per rank and step; gradients travel once, after the last
    accumulation_steps: int = Field(default=1, ge=1)
    #: fraction of the data held out for evaluation
    eval_fraction: float = Field(default=0.05, gt=0, lt=1)
    #: shuffle the training samples each epoch (seeded by ``train.seed``)
    shuffle: bool = True

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        return _check_reference(v, "data.factory")


class TrainingConfig(_Section):
    #: optimizer steps to train (a resumed run continues up to this step)
    steps: int = Field(default=300, ge=1)
    #: seed of the model's initialisation, the data order and dropout
    seed: int = 0
    #: compute dtype (``torch.autocast``; fp32 master parameters, outputs as computed); fp16 adds
    #: dynamic loss scaling agreed by every rank (an overflow anywhere skips the step and halves the scale)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: evaluate every N steps (and after the last); 0 disables evaluation
    eval_every: int = Field(default=50, ge=0)
    #: held-out batches per evaluation
    eval_batches: int = Field(default=4, ge=1)
    #: stop when the eval loss has not improved by ``early_stopping_min_delta`` for N evaluations; 0: off
    early_stopping_patience: int = Field(default=0, ge=0)
    #: the least eval-loss improvement that counts for early stopping
    early_stopping_min_delta: float = Field(default=0.0, ge=0)
    #: stop with an error after this many consecutive steps with a non-finite loss or gradient
    max_nonfinite_steps: int = Field(default=5, ge=1)


class CheckpointConfig(_Section):
    #: directory holding one sub-directory per saved step; ``None`` disables checkpoints
    dir: str | None = None
    #: save every N steps (and after the last step); 0: only at the end
    every: int = Field(default=0, ge=0)
    #: step directories kept in ``checkpoint.dir`` (older ones this run wrote are deleted)
    keep_last: int = Field(default=2, ge=1)
    #: resume from ``latest`` in ``checkpoint.dir``, or from an explicit step directory
    resume: bool | str = False
    #: a resume never falls back past a broken ``latest`` or a newest step that does not verify: a
    #: ``CheckpointError`` instead of a warning and the newest step directory that verifies
    strict_resume: bool = False
    #: resume with a fresh optimizer (no saved optimizer state, compression state included): needed to
    #: change ``optimizer.name`` on resume; parameters, data position and LR schedule are restored
    reset_optimizer: bool = False
    #: seconds after which another host's lock on ``dir``, not refreshed (its owner refreshes it every
    #: ``lock_stale_after / 4`` s, at most every 60 s), is taken over; a lock of a dead process on this
    #: host is taken over at once
    lock_stale_after: float = Field(default=600.0, gt=0)
    #: read step directories and files that are links resolving outside the checkpoint directory
    #: (refused by default: a checkpoint shared with you should not read your other files)
    allow_outside_links: bool = False

    @field_validator("dir", "resume")
    @classmethod
    def _not_empty(cls, v: str | bool | None) -> str | bool | None:
        if v == "":
            raise ValueError("an empty path; give a directory, or null (dir) / false (resume) to turn it off")
        return v


class ElasticConfig(_Section):
    #: commit the model and optimizer shards, data position, LR schedule and compression state every
    #: N steps, with a copy on the ring neighbour, so a lost rank loses nothing committed and at most
    #: N steps are redone (docs/elastic.md); 0: off
    commit_every: int = Field(default=0, ge=0)
    #: where the commits are held: ``None`` in memory; a node-local directory under torchrun elastic
    #: (its workers restart as new processes), one per node
    dir: str | None = None


class LoggingConfig(_Section):
    #: this run's directory (``metrics.jsonl``, ``profile.json``, ``loss.png``, event files); ``{time}``
    #: becomes the start time (a fresh directory per run); a directory holding another run's metrics
    #: gets a ``-2`` suffix; ``latest`` beside it points to the newest; ``None``: nothing written
    run_dir: str | None = "runs/{time}"
    #: write a metrics record (and a console line) every N steps
    log_every: int = Field(default=20, ge=1)
    #: a progress bar and metric lines on rank 0's console
    progress: bool = True
    #: TensorBoard event files in the run directory (``torch.utils.tensorboard``; ``pip install tensorboard``)
    tensorboard: bool = False
    #: log every metrics record to Weights & Biases (``pip install wandb``; ``WANDB_MODE=offline`` works)
    wandb: bool = False
    #: the W&B project name (``logging.wandb=true``)
    wandb_project: str = "dtlab"
    #: ``metrics.csv`` beside ``metrics.jsonl``: one row per record, fixed columns
    csv: bool = False
    #: ``loss.png`` in the run directory at the end of a run (training and eval loss against step and
    #: against bytes sent; needs matplotlib)
    plot: bool = True

    @field_validator("run_dir")
    @classmethod
    def _not_empty(cls, v: str | None) -> str | None:
        if v == "":
            raise ValueError("an empty path; give a directory, or null for no metrics and no profile")
        rest = "" if v is None else v.replace("{time}", "")
        if "{" in rest or "}" in rest:
            raise ValueError("the only placeholder allowed is {time} (the run's start time): runs/{time}")
        return v

    @model_validator(mode="after")
    def _packages(self) -> LoggingConfig:
        import importlib.util

        for field, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, field) and importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"logging.{field}=true needs the {package} package, which is not installed: "
                    f"pip install {package} (or pip install 'dtlab[{package}]'), or set logging.{field}=false"
                )
        if (self.tensorboard or self.wandb or self.csv) and self.run_dir is None:
            raise ValueError(
                "logging.tensorboard, logging.wandb and logging.csv write into logging.run_dir, which is "
                "null; give logging.run_dir a directory"
            )
        return self
