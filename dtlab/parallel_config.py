"""Checks of the config's ``parallel`` section, run before any rank starts (each error names the field).

:func:`check_parallel` needs only the config (divisibility of heads, vocabulary, sequence and layers,
the pipeline schedule's rules, settings that do not combine); :func:`check_mesh_size` also needs the
world size (the mesh fills the world; the global batch splits over dp ranks and micro-batches). The
section itself is :class:`dtlab.config.ParallelConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import TrainConfig

__all__ = ["VOCABULARY", "check_mesh_size", "check_parallel", "pipeline_block_names"]

#: the embedded transformer's vocabulary (bytes)
VOCABULARY = 256
#: model strategies that need a mesh whatever its sizes
MESH_STRATEGIES = ("tensor", "pipeline", "hybrid")
SP_NEEDS_TP = "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits tp's norm regions)"


def pipeline_block_names(n_layers: int) -> list[str]:
    """The pipeline blocks of the embedded ``TransformerLM`` (``TransformerLM.pipeline_blocks``)."""
    return ["embed", *[f"blocks.{i}" for i in range(n_layers)], "head"]


def check_parallel(config: TrainConfig) -> None:
    """Everything about ``parallel`` that does not depend on the world size."""
    par, name, m = config.parallel, config.strategy.model, config.model
    if name == "tensor" and par.pp > 1:
        raise ConfigError(
            f"strategy.model='tensor' runs on the dp x tp mesh, but parallel.pp={par.pp}; use "
            "strategy.model=hybrid (or a data-parallel strategy such as ddp) for pipeline stages too"
        )
    if name == "pipeline" and par.tp > 1:
        raise ConfigError(
            f"strategy.model='pipeline' runs on the pp x dp mesh, but parallel.tp={par.tp}; use "
            "strategy.model=hybrid (or a data-parallel strategy such as ddp) for tensor parallelism too"
        )
    mesh = par.model_parallel or name in MESH_STRATEGIES
    if not mesh:
        _unused_pipeline_settings(config)
        if par.sequence_parallel:
            raise ConfigError(SP_NEEDS_TP)
        return
    if m.name != "transformer_lm":
        raise ConfigError(
            f"parallel.tp={par.tp}, parallel.pp={par.pp} with strategy.model={name!r}: model parallelism "
            f"runs the embedded transformer (model.name=transformer_lm), not model.name={m.name!r}"
        )
    if config.elastic.commit_every:
        raise ConfigError(
            f"elastic.commit_every={config.elastic.commit_every} with parallel.tp={par.tp}, parallel.pp="
            f"{par.pp}: an elastic world changes size, which a fixed mesh cannot follow; set "
            "elastic.commit_every=0 or train data-parallel only"
        )
    if config.strategy.activation_checkpointing and par.pp > 1 and par.schedule == "zero_bubble":
        raise ConfigError(
            "strategy.activation_checkpointing=true with parallel.schedule='zero_bubble': zero-bubble "
            "defers the weight gradients of the forward it recorded, which a checkpointed stage "
            "recomputes; use parallel.schedule=1f1b (or gpipe, interleaved_1f1b) with checkpointing"
        )
    _check_tensor(config)
    _check_pipeline(config)


def _unused_pipeline_settings(config: TrainConfig) -> None:
    par = config.parallel
    if par.pp > 1:
        return
    if par.micro_batches is not None and par.micro_batches != 1:
        raise ConfigError(
            f"parallel.micro_batches={par.micro_batches} applies to pipelines (parallel.pp > 1); with "
            "parallel.pp=1 accumulate with data.accumulation_steps instead"
        )
    if par.split_points:
        raise ConfigError(
            f"parallel.split_points={par.split_points} cuts pipeline stages, but parallel.pp=1; set "
            "parallel.pp > 1 or leave parallel.split_points unset"
        )
    if par.stages_per_rank != 1:
        raise ConfigError(
            f"parallel.stages_per_rank={par.stages_per_rank} applies to pipelines (parallel.pp > 1)"
        )


def _check_tensor(config: TrainConfig) -> None:
    par, m = config.parallel, config.model
    tp = par.tp
    if par.sequence_parallel and tp == 1:
        raise ConfigError(SP_NEEDS_TP)
    if tp == 1:
        return
    if m.n_heads % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide model.n_heads={m.n_heads} (each tp rank holds whole "
            f"heads); choose a tp that divides {m.n_heads}"
        )
    if VOCABULARY % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the vocabulary of {VOCABULARY} bytes (the embedding and "
            "the head are split by vocabulary); choose a power of two"
        )
    if par.sequence_parallel and m.seq_len % tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over parallel.tp={tp}, but "
            f"model.seq_len={m.seq_len} is not divisible by {tp}; choose a seq_len divisible by {tp}"
        )


def _check_pipeline(config: TrainConfig) -> None:
    par, m = config.parallel, config.model
    if par.pp == 1:
        _unused_pipeline_settings(config)
        return
    stages = par.pp * par.stages_per_rank
    blocks = pipeline_block_names(m.n_layers)
    if m.n_layers % stages:
        raise ConfigError(
            f"parallel.pp={par.pp} x parallel.stages_per_rank={par.stages_per_rank} = {stages} stages do not "
            f"divide model.n_layers={m.n_layers} (each stage gets the same number of transformer blocks, "
            f"as dtlab advise plans them); use a number of layers divisible by {stages} or fewer stages"
        )
    mb = par.micro_batch_count
    if mb < par.pp:
        raise ConfigError(
            f"parallel.micro_batches={mb} is fewer than parallel.pp={par.pp}: every stage would idle while "
            f"it waits; use parallel.micro_batches >= {par.pp}"
        )
    from dtlab.errors import ArgumentError
    from dtlab.models.pipeline._schedules import check_schedule_args

    try:
        check_schedule_args(par.schedule, par.pp, mb, par.stages_per_rank)
    except ArgumentError as exc:
        raise ConfigError(
            f"parallel.schedule={par.schedule!r} with parallel.pp={par.pp}, parallel.micro_batches={mb}, "
            f"parallel.stages_per_rank={par.stages_per_rank}: {exc}"
        ) from None
    if par.split_points is not None:
        points = list(par.split_points)
        unknown = [p for p in points if p not in blocks]
        order = [blocks.index(p) for p in points if p in blocks]
        if len(points) != stages - 1 or unknown or order != sorted(set(order)) or 0 in order:
            raise ConfigError(
                f"parallel.split_points={points}: {stages} stages need {stages - 1} distinct block names "
                f"after the first, in order, from {blocks}"
                + (f" ({unknown} name no block)" if unknown else "")
            )
    if config.data.accumulation_steps > 1:
        raise ConfigError(
            f"data.accumulation_steps={config.data.accumulation_steps} with parallel.pp={par.pp}: the "
            "pipeline's micro-batches are its accumulation; set parallel.micro_batches instead"
        )


def check_mesh_size(config: TrainConfig, world_size: int) -> None:
    """The mesh fills the world and the global batch splits over dp ranks (and micro-batches)."""
    par, d = config.parallel, config.data
    tp, pp = par.tp, par.pp
    if par.dp is not None:
        if par.dp * tp * pp != world_size:
            raise ConfigError(
                f"parallel.dp={par.dp} x parallel.tp={tp} x parallel.pp={pp} = {par.dp * tp * pp} ranks, "
                f"but the world has {world_size} (backend.world_size or the launcher); make the product "
                f"equal {world_size} or leave parallel.dp unset (world / (tp x pp))"
            )
    elif world_size % (tp * pp):
        raise ConfigError(
            f"parallel.tp={tp} x parallel.pp={pp} = {tp * pp} does not divide the world of {world_size} "
            "ranks (backend.world_size or the launcher); the dp axis is world / (tp x pp)"
        )
    dp = par.dp_size(world_size)
    g, a = d.global_batch_size, d.accumulation_steps
    if g % (dp * a):
        ok = dp * a
        raise ConfigError(
            f"data.global_batch_size={g} is not divisible by the dp axis x data.accumulation_steps = "
            f"{dp} x {a} = {ok} (dp = parallel.dp or world {world_size} / (tp {tp} x pp {pp})); use a "
            f"multiple of {ok} (e.g. {max(ok, g - g % ok)})"
        )
    if pp > 1:
        mb = par.micro_batch_count
        local = g // dp
        if local % mb:
            ok = dp * mb
            raise ConfigError(
                f"data.global_batch_size={g} gives each of the {dp} dp ranks {local} samples, not divisible "
                f"into parallel.micro_batches={mb}; use a global batch that is a multiple of dp x "
                f"micro_batches = {ok} (e.g. {max(ok, g - g % ok)})"
            )
