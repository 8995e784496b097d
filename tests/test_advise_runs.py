"""``dtlab advise`` against dtlab's own runs: the predicted memory per rank and bytes per rank per axis
of a plan equal what the strategies report (``memory_report()``) and what the backends count
(``backend.stats``) in a real step of the embedded transformer on in-memory ranks.

The issue's bar is 5%; the data-parallel strategies are predicted exactly, so the tests assert equality
where the model is exact and the 5% bound only where it is an estimate (activations).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, OptimizerSpec, StrategyOptions, predict
from dtlab.advise.activations import block_bytes_per_token
from dtlab.config import StrategyConfig, load_config
from dtlab.errors import ArgumentError
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers.build import build_model_strategy, build_optimizer_strategy
from dtlab.trainers.tasks import build_task, cross_entropy_loss

SIZES = ["model.n_layers=2", "model.seq_len=16", "data.global_batch_size=8", "optimizer.name=adamw"]
MEMORY_KEYS = ("parameters", "gradients", "optimizer_state", "peak_gathered_parameters")


def _same_memory(got: dict[str, int], predicted: dict[str, int]) -> dict[str, int]:
    """The keys advise predicts for every rank alike: all but ``optimizer_state``, which it predicts
    for the rank that holds the most (a sharded optimizer keeps one piece per parameter its shard
    overlaps, and no moments for padding): see :func:`_largest_state`."""
    return {k: got[k] for k in predicted if k != "optimizer_state"}


def _largest_state(measured: list[dict[str, Any]]) -> int:
    return max(got["memory"]["optimizer_state"] for got in measured)


def _assert_memory_as_predicted(measured: list[dict[str, Any]], pred: Any) -> None:
    """Every rank's parameters, gradients and gathered peak as predicted; the largest optimizer state."""
    predicted = {
        "parameters": pred.memory.parameters,
        "gradients": pred.memory.gradients,
        "optimizer_state": pred.memory.optimizer_state,
        "peak_gathered_parameters": pred.peak_gathered_parameters,
    }
    assert _largest_state(measured) == predicted["optimizer_state"]
    for rank, got in enumerate(measured):
        assert _same_memory(got["memory"], predicted) == _same_memory(predicted, predicted), f"rank {rank}"


def _config(strategy: str, world: int) -> Any:
    return load_config(
        overrides=[*TINY_LM, *SIZES, f"strategy.model={strategy}", f"backend.world_size={world}"]
    )


def _spec(config: Any) -> ModelSpec:
    m = config.model
    return ModelSpec.builtin(d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, seq_len=m.seq_len)


class SavedBytes:
    """Bytes autograd keeps for the backward (distinct storages; parameters and the batch left out, as
    the pipeline's own meter does): the measure of activation memory, taken with
    ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in excluded if p.numel()}
        self._seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            st = t.untyped_storage()
            if st.data_ptr() not in self._params:
                self._seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())


def _two_steps(backend: Any, config: Any, task: Any, measure_activations: bool) -> dict[str, Any]:
    model, _ = build_model_strategy(config, backend, task)
    opt = build_optimizer_strategy(config, model)
    g = torch.Generator().manual_seed(100 + backend.rank)
    local = config.data.global_batch_size // backend.world_size
    saved = None
    for step in range(2):
        x = torch.randint(0, 256, (local, config.model.seq_len), generator=g)
        y = torch.randint(0, 256, (local, config.model.seq_len), generator=g)
        if step == 1:
            backend.stats.reset()  # the second step: optimizer state exists, counters hold one step
        if step == 1 and measure_activations:
            saved = SavedBytes([*model.parameters(), x, y])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = cross_entropy_loss(model(x), y)
        else:
            loss = cross_entropy_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {
        "memory": opt.memory_report(),
        "ops": {k: (v["calls"], v["bytes_sent"]) for k, v in backend.stats.snapshot().items()},
        "activations": None if saved is None else saved.total,
    }


def test_strategy_options_are_dtlab_train_defaults() -> None:
    s = StrategyConfig()
    o = StrategyOptions()
    assert (
        o.bucket_cap_mb,
        o.persistence_threshold,
        o.reshard_after_forward,
        o.prefetch,
        o.gradient_sync,
    ) == (
        s.bucket_cap_mb,
        s.persistence_threshold,
        s.reshard_after_forward,
        s.prefetch,
        s.gradient_sync,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_data_parallel_memory_and_bytes_equal_the_run(strategy: str, world: int) -> None:
    config = _config(strategy, world)
    task = build_task(config)
    measured = run_world(world, _two_steps, config, task, strategy in ("ddp", "zero1", "zero2"))
    spec = _spec(config)
    plan = Candidate(strategy, dp=world)  # type: ignore[arg-type]
    pred = predict(
        spec, ClusterSpec(ranks=world), plan, config.data.global_batch_size, optimizer=OptimizerSpec()
    )
    _assert_memory_as_predicted(measured, pred)
    for rank, got in enumerate(measured):
        assert got["ops"] == pred.axes["dp"].ops, f"rank {rank}"
        if got["activations"] is not None:
            assert got["activations"] == pytest.approx(pred.memory.activations, rel=0.05)
    assert pred.axes["tp"].ops == {} and pred.axes["pp"].ops == {}


def _accumulating_steps(backend: Any, config: Any, task: Any, micro: int) -> dict[str, Any]:
    """Two steps of ``micro`` micro-batches each, all but the last under ``no_sync`` (as the Trainer
    accumulates); the counters hold the second step."""
    model, _ = build_model_strategy(config, backend, task)
    opt = build_optimizer_strategy(config, model)
    g = torch.Generator().manual_seed(100 + backend.rank)
    local = config.data.global_batch_size // backend.world_size
    for step in range(2):
        if step == 1:
            backend.stats.reset()
        for i in range(micro):
            x = torch.randint(0, 256, (local // micro, config.model.seq_len), generator=g)
            y = torch.randint(0, 256, (local // micro, config.model.seq_len), generator=g)
            if i < micro - 1:
                with model.no_sync():
                    cross_entropy_loss(model(x), y).backward()
            else:
                cross_entropy_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {
        "memory": opt.memory_report(),
        "ops": {k: (v["calls"], v["bytes_sent"]) for k, v in backend.stats.snapshot().items()},
    }


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_gradient_accumulation_equals_the_run(strategy: str) -> None:
    """Without a pipeline, micro-batches accumulate: gradients reduced once per step, ZeRO-3/FSDP
    units gathered again for every micro-batch."""
    config = _config(strategy, 2)
    measured = run_world(2, _accumulating_steps, config, build_task(config), 2)
    plan = Candidate(strategy, dp=2, micro_batches=2)  # type: ignore[arg-type]
    pred = predict(_spec(config), ClusterSpec(ranks=2), plan, config.data.global_batch_size)
    assert pred.micro_batch == 2 and plan.label.endswith("accum2")
    for rank, got in enumerate(measured):
        assert got["ops"] == pred.axes["dp"].ops, f"rank {rank}"
        assert got["memory"]["parameters"] == pred.memory.parameters
    assert _largest_state(measured) == pred.memory.optimizer_state
    one = predict(_spec(config), ClusterSpec(ranks=2), Candidate(strategy, dp=2), 8)  # type: ignore[arg-type]
    assert pred.memory.activations < one.memory.activations  # half the sequences in flight


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_checkpointed_blocks_under_data_parallelism_equal_the_run(strategy: str) -> None:
    """dtlab train's per-block checkpointing: ZeRO-3's recomputed forward gathers each block's
    modules again (all but the last, where torch's checkpoint stops); FSDP's block stays gathered."""
    config = load_config(
        overrides=[*TINY_LM, *SIZES, f"strategy.model={strategy}", "backend.world_size=2",
                   "strategy.activation_checkpointing=true"]
    )  # fmt: skip
    measured = run_world(2, _two_steps, config, build_task(config), strategy == "ddp")
    plan = Candidate(strategy, dp=2, checkpointing="block")  # type: ignore[arg-type]
    pred = predict(_spec(config), ClusterSpec(ranks=2), plan, config.data.global_batch_size)
    assert _largest_state(measured) == pred.memory.optimizer_state
    for rank, got in enumerate(measured):
        assert got["ops"] == pred.axes["dp"].ops, f"rank {rank}"
        assert {k: got["memory"][k] for k in ("parameters", "gradients")} == {
            "parameters": pred.memory.parameters,
            "gradients": pred.memory.gradients,
        }
        if got["activations"] is not None:
            assert got["activations"] == pred.memory.activations


TP_SPEC = ModelSpec.builtin(d_model=32, n_layers=2, n_heads=4, seq_len=16)
TP_BATCH = 8


def _tensor_steps(
    backend: Any, shape: dict[str, int], strategy: str, s: ModelSpec = TP_SPEC, checkpointing: bool = False
) -> dict[str, Any]:
    from dtlab.backends import Mesh
    from dtlab.models import TensorParallelModel, transformer_plan
    from dtlab.models.checkpointing import checkpoint_modules
    from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
    from dtlab.trainers.models import Block, TransformerLM

    mesh = Mesh(backend, shape)
    with torch.random.fork_rng(devices=[]):  # in-memory ranks share the RNG: values come from rank 0
        net = TransformerLM(s.hidden, s.layers, s.heads, s.seq_len)
    if checkpointing:  # what dtlab train does with tp alone: per block
        checkpoint_modules(net, (Block,))
    model = TensorParallelModel(net, mesh, plan=transformer_plan())
    opt = (DDPOptimizer if strategy == "ddp" else ZeRO1Optimizer)(model, torch.optim.AdamW, lr=1e-3)
    dp = mesh["dp"]
    g = torch.Generator().manual_seed(100 + dp.rank)  # the tp ranks of a replica see the same batch
    local = TP_BATCH // dp.world_size
    saved = None
    for step in range(2):
        x = torch.randint(0, 256, (local, s.seq_len), generator=g)
        y = torch.randint(0, 256, (local, s.seq_len), generator=g)
        if step == 1:
            for axis in ("dp", "tp"):
                mesh[axis].stats.reset()
            saved = SavedBytes([*model.parameters(), x, y])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = model.cross_entropy(model(x), y)
        else:
            loss = model.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {
        "memory": opt.memory_report(),
        "ops": {
            axis: {k: (v["calls"], v["bytes_sent"]) for k, v in mesh[axis].stats.snapshot().items()}
            for axis in ("dp", "tp")
        },
        "activations": saved.total if saved else None,
    }


def _as_train_step(ops: dict[str, tuple[int, int]], tp: int) -> dict[str, tuple[int, int]]:
    """The loop's tp traffic as train_step's, which advise predicts: the loop checks that the tp ranks
    agree twice (the forward's inputs, the loss's targets: an all-reduce of 6 int64 each), train_step
    once for its whole batch."""
    calls, nbytes = ops["all_reduce"]
    return {**ops, "all_reduce": (calls - 1, nbytes - 2 * (tp - 1) * 48 // tp)}


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("shape", [{"tp": 2}, {"dp": 2, "tp": 2}, {"tp": 4}])
def test_tensor_parallel_memory_and_bytes_equal_the_run(shape: dict[str, int], strategy: str) -> None:
    world = 1
    for n in shape.values():
        world *= n
    measured = run_world(world, _tensor_steps, shape, strategy)
    plan = Candidate(strategy, dp=shape.get("dp", 1), tp=shape["tp"])  # type: ignore[arg-type]
    pred = predict(TP_SPEC, ClusterSpec(ranks=world), plan, TP_BATCH)
    _assert_memory_as_predicted(measured, pred)
    for rank, got in enumerate(measured):
        for axis in ("dp", "tp"):
            moved = {k: v for k, v in got["ops"][axis].items() if v[1]}  # size-1 groups: 0-byte calls
            if axis == "tp":
                moved = _as_train_step(moved, shape["tp"])
            assert moved == pred.axes[axis].ops, f"rank {rank} {axis}"
        assert got["activations"] == pytest.approx(pred.memory.activations, rel=0.05), f"rank {rank}"


@pytest.mark.parametrize(("shape", "layers"), [({"tp": 2}, 2), ({"dp": 2, "tp": 2}, 4)])
def test_checkpointed_blocks_under_tensor_parallelism_equal_the_run(
    shape: dict[str, int], layers: int
) -> None:
    """Per-block checkpointing under tp: the recomputed forward reruns each block's attention
    all-reduce (torch stops recomputing before the MLP's); the blocks keep only their inputs."""
    spec = ModelSpec.builtin(d_model=32, n_layers=layers, n_heads=4, seq_len=16)
    world = shape.get("dp", 1) * shape["tp"]
    measured = run_world(world, _tensor_steps, shape, "ddp", spec, True)
    plan = Candidate("ddp", dp=shape.get("dp", 1), tp=shape["tp"], checkpointing="block")
    pred = predict(spec, ClusterSpec(ranks=world), plan, TP_BATCH)
    if shape == {"tp": 2}:  # 2 blocks: 13 all-reduces without checkpointing, 2 more with it, 1 check
        assert pred.axes["tp"].ops == {"all_reduce": (16, 198_192)}
        for when in ("first", "never"):  # the steady step of a model built so: no check (48 bytes)
            options = StrategyOptions(tp_batch_check=when)
            other = predict(spec, ClusterSpec(ranks=world), plan, TP_BATCH, options=options)
            assert other.axes["tp"].ops == {"all_reduce": (15, 198_192 - 48)}, when
        with pytest.raises(ArgumentError, match="tp_batch_check must be one of 'always', 'first', 'never'"):
            StrategyOptions(tp_batch_check="sometimes")  # type: ignore[arg-type]
    for rank, got in enumerate(measured):
        moved = _as_train_step({k: v for k, v in got["ops"]["tp"].items() if v[1]}, shape["tp"])
        assert moved == pred.axes["tp"].ops, f"rank {rank}"
        assert got["activations"] == pred.memory.activations, f"rank {rank}"
        assert got["memory"]["parameters"] == pred.memory.parameters
    # one block's working set, rebuilt once at a time, on top of what the blocks keep
    tokens = TP_BATCH // shape.get("dp", 1) * spec.seq_len
    assert pred.memory.recompute == block_bytes_per_token(spec, shape["tp"], 4) * tokens
