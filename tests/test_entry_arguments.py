"""The public entry points refuse an argument of the wrong kind (a ``"gloo"`` string where a backend
goes, a dict where a config goes, a module where a function building one goes) with one error naming
the argument and what to pass, before anything reads it: never an ``AttributeError`` from deep inside."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends import GlooBackend, InMemoryWorld, Mesh, detect_launcher, init_backend
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import load_pretrained, save_checkpoint
from dtlab.compression import GradientSynchronizer, OkTopk, RandomK, make_compressor
from dtlab.config import load_config
from dtlab.core.reducer import DenseReducer
from dtlab.core.rng import seeded_init
from dtlab.data import DistributedSampler, TensorDataset, stdlib_lm_dataset
from dtlab.errors import (
    ArgumentError,
    ArgumentTypeError,
    CheckpointError,
    ConfigError,
    DtlabError,
    StrategyError,
)
from dtlab.models import (
    ColumnParallelLinear,
    DDPModel,
    FSDPModel,
    HeadsParallel,
    HybridShardedModel,
    PipelineParallelModel,
    RowParallelLinear,
    TensorParallelModel,
    VocabParallelEmbedding,
    ZeRO2Model,
    ZeRO3Model,
    apply_tensor_plan,
    bart_plan,
    bert_plan,
    gpt2_plan,
    plot_schedule,
    vocab_parallel_cross_entropy,
)
from dtlab.optimizers import AsyncSGDOptimizer, DDPOptimizer, ZeRO2Optimizer
from dtlab.testing import Kill, run_elastic, run_world, spawn_world
from dtlab.trainers import Task, Trainer, build_task, run_training


def _net() -> nn.Module:
    with seeded_init(0):
        return nn.Linear(4, 2)


NOT_A_BACKEND: list[tuple[str, Callable[[], Any]]] = [
    ("Mesh", lambda: Mesh("gloo", {"dp": 1})),  # type: ignore[arg-type]
    ("ColumnParallelLinear(group=...)", lambda: ColumnParallelLinear(4, 4, "gloo")),  # type: ignore[arg-type]
    ("RowParallelLinear(group=...)", lambda: RowParallelLinear(4, 4, "gloo")),  # type: ignore[arg-type]
    ("VocabParallelEmbedding(group=...)", lambda: VocabParallelEmbedding(8, 4, "gloo")),  # type: ignore[arg-type]
    ("GradientSynchronizer", lambda: GradientSynchronizer(OkTopk(), "gloo")),  # type: ignore[arg-type]
    ("DenseReducer", lambda: DenseReducer("gloo")),  # type: ignore[arg-type]
    ("AsyncSGDOptimizer", lambda: AsyncSGDOptimizer(_net(), "gloo", torch.optim.SGD, lr=0.1)),  # type: ignore[arg-type]
    ("Trainer", lambda: Trainer(load_config(), "gloo")),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("who, call", NOT_A_BACKEND, ids=[w for w, _ in NOT_A_BACKEND])
def test_a_string_where_a_backend_goes_is_named(
    who: str, call: Callable[[CommunicationBackend], Any]
) -> None:
    with pytest.raises(
        ArgumentTypeError, match=rf"^{re.escape(who)} needs a dtlab CommunicationBackend, got str: pass"
    ):
        call()


def test_arguments_of_another_kind_are_named_with_the_fix() -> None:
    def body(b: CommunicationBackend) -> None:
        with pytest.raises(ArgumentTypeError, match=r"Mesh: sizes must map axis names to sizes.*got 'dp'"):
            Mesh(b, "dp")  # type: ignore[arg-type]
        with pytest.raises(
            ArgumentTypeError, match=r"ColumnParallelLinear: in_features must be an int >= 0, got 4.0"
        ):
            ColumnParallelLinear(4.0, 4, b)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=r"reduce_dtype must be a floating-point torch.dtype.*got 'bf16'"
        ):
            DenseReducer(b, "bf16")  # type: ignore[arg-type]
        # a wrapped model would synchronize twice (its own hooks and the servers): the module itself goes
        with pytest.raises(
            ArgumentTypeError, match=r"plain torch.nn.Module.*got a DDPModel; pass the module"
        ):
            AsyncSGDOptimizer(DDPModel(_net(), b), b, torch.optim.SGD, lr=0.1)
        with pytest.raises(ArgumentTypeError, match=r"AsyncSGDOptimizer trains a torch.nn.Module, got str"):
            AsyncSGDOptimizer("net", b, torch.optim.SGD, lr=0.1)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match=r"Trainer: task must be a dtlab.trainers.Task.*got str"):
            Trainer(load_config(), b, "lm")  # type: ignore[arg-type]

    run_world(1, body)
    for call, who in [(run_training, "run_training"), (build_task, "build_task")]:
        with pytest.raises(
            ArgumentTypeError, match=rf"^{who} takes a dtlab.config.TrainConfig, got dict; build"
        ):
            call({"train": {"steps": 2}})  # type: ignore[operator]
    with pytest.raises(ArgumentTypeError, match=r"stop must be a dtlab.trainers.StopRequest.*got str"):
        run_training(load_config(), stop="SIGTERM")  # type: ignore[arg-type]
    data = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    with pytest.raises(
        ArgumentTypeError, match=r"Task.build_model is a function building the model, got Linear"
    ):
        Task(nn.Linear(4, 2), data, data)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"Task.loss_fn must be a function"):
        Task(_net, data, data, loss_fn="mse")  # type: ignore[arg-type]


def test_values_that_were_taken_or_failed_deep_inside_are_named() -> None:
    # before: a raw TypeError/AttributeError/ZeroDivisionError from inside, or the value silently taken
    # (reshard_after_forward='no' as true, split_points='layers.1' as 8 block names, densty= ignored)
    def body(b: CommunicationBackend) -> None:
        with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number of megabytes > 0.*got '25'"):
            DDPModel(_net(), b, bucket_cap_mb="25")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"leaf_modules must be a tuple of nn.Module subclasses"):
            ZeRO3Model(_net(), b, leaf_modules=nn.Linear)  # type: ignore[arg-type]
        with pytest.raises(
            ArgumentTypeError, match=r"^reshard_after_forward must be True, False or None .*got 'no'"
        ):
            FSDPModel(_net(), b, reshard_after_forward="no")  # type: ignore[arg-type]
        model = DDPModel(_net(), b)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
        for group in ({"params": "weight"}, [next(model.parameters())]):
            with pytest.raises(
                TypeError, match=r"DDPOptimizer.add_param_group\(\) takes a dict whose 'params'"
            ):
                opt.add_param_group(group)  # type: ignore[arg-type]
        with pytest.raises(
            TypeError, match=r"load_state_dict\(\) takes a mapping.*got str; read a file first"
        ):
            model.load_state_dict("model.pt")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"expects the list of every saved rank's ShardedState"):
            model.load_sharded_state_dict(["model.pt"])  # type: ignore[list-item]
        with pytest.raises(StrategyError, match=r"sections must be an int >= 1"):
            ColumnParallelLinear(4, 8, b, sections=0)
        with pytest.raises(
            StrategyError, match=r"targets are class ids.*got torch.float32; pass targets.long"
        ):
            vocab_parallel_cross_entropy(torch.zeros(4, 10), torch.zeros(4), b)

    run_world(1, body)

    def pipeline(b: CommunicationBackend) -> None:
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        with pytest.raises(
            ArgumentTypeError, match=r"split_points must be a list of block names, e\.g\. \['1'\]"
        ):
            PipelineParallelModel(net, Mesh(b, {"pp": 2}), split_points="1")

    run_world(2, pipeline)
    with pytest.raises(
        StrategyError, match=r"HeadsParallel\(qkv=...\) is a tuple of names, e\.g\. \('c_attn',\)"
    ):
        HeadsParallel(qkv="c_attn")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"no compressor has the options \['densty'\]; they are \["):
        make_compressor("oktopk", densty=0.1)
    with pytest.raises(ValueError, match=r"max_bytes must be an int >= 1024.*got 1000"):
        stdlib_lm_dataset(1000, 8)  # was "found only 1000 bytes of Python source": the stdlib said missing
    with pytest.raises(ValueError, match=r"seq_len must be an int >= 1.*got 0"):
        stdlib_lm_dataset(4096, 0)
    with pytest.raises(TypeError, match=r"TensorDataset: inputs must be a tensor with one row per sample"):
        TensorDataset([1, 2], [1, 2])  # type: ignore[arg-type]
    data = TensorDataset(torch.zeros(8, 4), torch.zeros(8))
    with pytest.raises(TypeError, match=r"DistributedSampler: seed must be an int, got 'x'"):
        DistributedSampler(data, 2, 0, seed="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"DistributedSampler needs a map-style dataset.*got generator"):
        DistributedSampler((x for x in range(3)), 2, 0)  # type: ignore[arg-type]


def test_checkpoint_and_train_step_arguments_are_named(tmp_path: Path) -> None:
    # before: save_checkpoint(step=-1) wrote step_-0000001, a directory no resume lists; step='5' "Unknown
    # format code 'd'"; a plain state dict "no attribute 'tensors'"; an optimizer loading a model's shards
    # took them as no state; train_step(batch, None) "'NoneType' object is not callable" on the last stage
    def body(b: CommunicationBackend) -> None:
        model = ZeRO2Model(_net(), b)
        opt = ZeRO2Optimizer(model, torch.optim.Adam, lr=0.1)
        state = model.sharded_state_dict()
        bad: list[tuple[dict[str, Any], str]] = [
            ({"step": -1}, r"step must be an int >= 0, got -1"),
            ({"step": "5"}, r"step must be an int >= 0, got '5'"),
            ({"model_state": model.state_dict()}, r"model_state must be a ShardedState.*got OrderedDict"),
            ({"rank_state": "rng"}, r"rank_state must be a dict of tensors"),
            ({"keep_last": -1}, r"keep_last must be an int >= 0, got -1"),
            ({"run_tag": "a-b"}, r"run_tag must be letters and digits"),
        ]
        for change, text in bad:
            args: dict[str, Any] = {"root": tmp_path, "step": 1, "backend": b, "model_state": state}
            args |= {"optim_state": None, "rank_state": {}, "meta": {}, **change}
            with pytest.raises(DtlabError, match=rf"^save_checkpoint: {text}"):
                save_checkpoint(**args)
        assert not any(tmp_path.iterdir())  # refused before anything was written
        with pytest.raises(
            CheckpointError, match=r"state_keys=None.*a model's sharded_state_dict\(\) has none"
        ):
            opt.load_sharded_state_dict([state])

    run_world(1, body)

    def pipeline(b: CommunicationBackend) -> None:
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model = PipelineParallelModel(net, Mesh(b, {"pp": 2}), micro_batches=2)
        with pytest.raises(
            StrategyError, match=r"loss_fn must be a function of \(output, targets\).*got None"
        ):
            model.train_step((torch.ones(4, 4), torch.ones(4, 2)), None)  # type: ignore[arg-type]

    run_world(2, pipeline, timeout=30)


def test_a_seed_a_plan_key_or_a_schedule_name_of_the_wrong_kind_is_named() -> None:
    # before: RandomK(seed='x') failed at its first compression (after warmup); a plan keyed by an int
    # "'int' object has no attribute 'split'"; a schedule typo without a pipeline was taken
    with pytest.raises(ConfigError, match=r"^RandomK: seed must be an integer >= 0, got 'x'"):
        RandomK(seed="x")  # type: ignore[arg-type]

    def body(b: CommunicationBackend) -> None:
        with pytest.raises(
            StrategyError, match=r"plan \{'fqn-pattern' \(a str\): style\}.*got \{0: 'colwise'\}"
        ):
            TensorParallelModel(_net(), Mesh(b, {"tp": 1}), plan={0: "colwise"})  # type: ignore[dict-item]
        with pytest.raises(ArgumentError, match=r"unknown pipeline schedule '1fb1'; choose one of"):
            HybridShardedModel(_net(), Mesh(b, {"dp": 1}), schedule="1fb1")

    run_world(1, body)


def test_testing_backend_and_plan_helpers_name_a_value_of_the_wrong_kind(tmp_path: Path) -> None:
    # before: run_elastic(schedule=['x']) "'str' object has no attribute 'step'"; init_backend(timeout='10')
    # "'<=' not supported"; init_backend(env='x', check_collectives='yes') taken; gpt2_plan(prefix=None)
    # planned 'Nonewte'; plot_schedule(costs={'F': 3.0}) drew the default costs
    with pytest.raises(
        ArgumentError, match=r"schedule entries are Kill\(step, rank\) or Join\(step, count\).*'x'"
    ):
        run_elastic(_net, 2, schedule=["x"])  # type: ignore[list-item]
    with pytest.raises(ArgumentError, match=r"schedule entries .* of ints, got Kill\(step='1', rank=0\)"):
        run_elastic(_net, 2, schedule=[Kill("1", 0)])  # type: ignore[arg-type]
    with pytest.raises(
        ArgumentTypeError, match=r"^init_backend: timeout must be a number of seconds, got '10'"
    ):
        init_backend("inmemory", timeout="10")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"^init_backend: env must be a mapping such as os.environ"):
        init_backend("inmemory", env="RANK=0")  # type: ignore[arg-type]
    with pytest.raises(
        ArgumentTypeError, match=r"^init_backend: check_collectives must be True, False or None"
    ):
        init_backend("inmemory", check_collectives="yes")  # type: ignore[arg-type]
    for make, example in [(gpt2_plan, "transformer."), (bert_plan, "bert."), (bart_plan, "model.")]:
        for prefix in (None, example[:-1]):
            with pytest.raises(StrategyError, match=r"prefix=...\) is '' or a module path ending in '\.'"):
                make(prefix)  # type: ignore[arg-type]
    with pytest.raises(
        ArgumentError, match=r"costs are keyed by Kind.F, Kind.B, Kind.I or Kind.W, got \['F'\]"
    ):
        plot_schedule("1f1b", 2, 4, tmp_path / "s.png", costs={"F": 3.0})  # type: ignore[dict-item]


def test_a_module_group_path_env_or_switch_of_the_wrong_kind_is_named() -> None:
    # before: apply_tensor_plan('net' | net with 'gloo') raw AttributeErrors; load_pretrained(model, 5)
    # os's "expected str, bytes or os.PathLike"; detect_launcher(env='RANK=0') searched the string as text;
    # DDPModel(broadcast_buffers=None) took None as False (no broadcast), find_unused_parameters='no' as True
    with pytest.raises(
        ArgumentTypeError, match=r"^detect_launcher: env must be a mapping such as os.environ"
    ):
        detect_launcher(env="RANK=0")  # type: ignore[arg-type]
    for timeout in (-1, float("inf")):  # taken before: a wait never bounded, or every wait failing at once
        with pytest.raises(
            ArgumentError, match=r"^GlooBackend: timeout must be a finite number of seconds > 0"
        ):
            GlooBackend(timeout=timeout)

    def body(b: CommunicationBackend) -> None:
        with pytest.raises(ArgumentTypeError, match=r"^apply_tensor_plan takes a torch.nn.Module, got str"):
            apply_tensor_plan("net", {"0": "colwise"}, b)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match=r"^apply_tensor_plan\(group=...\) needs a dtlab Comm"):
            apply_tensor_plan(_net(), {"0": "colwise"}, "gloo")  # type: ignore[arg-type]
        with pytest.raises(
            ArgumentTypeError, match=r"^load_pretrained: path must be a file or directory.*got 5"
        ):
            load_pretrained(DDPModel(_net(), b), 5)  # type: ignore[arg-type]
        for switch in ({"broadcast_buffers": None}, {"find_unused_parameters": "no"}):
            with pytest.raises(ArgumentTypeError, match=rf"^{next(iter(switch))} must be True or False"):
                DDPModel(_net(), b, **switch)  # type: ignore[arg-type]

    run_world(1, body)


def test_a_sampler_given_numpy_integers_shuffles_as_with_ints() -> None:
    # they passed the check (numbers.Integral), then torch.Generator.manual_seed(seed + epoch) raised its
    # raw "an integer is required" at the first iteration
    np = pytest.importorskip("numpy")
    data = list(range(10))
    given = DistributedSampler(data, np.int64(2), np.int64(1), seed=np.int64(3))
    given.set_epoch(1)
    plain = DistributedSampler(data, 2, 1, seed=3)
    plain.set_epoch(1)
    assert list(given) == list(plain)


def _generator_fn(backend: CommunicationBackend) -> Iterator[int]:
    yield backend.rank


def _rank(backend: CommunicationBackend) -> int:
    return backend.rank


def test_a_fn_that_would_run_nothing_and_a_float_world_are_named() -> None:
    # before: a rank's raw "'str' object is not callable"; a generator object per rank, the body never
    # run; InMemoryWorld(2.0) taken, then range() failing; spawn_world(may_die=[5]) taken
    calls: list[tuple[Any, str]] = [
        (
            lambda: run_world(2, "train"),
            r"^run_world: fn must be a function of the rank's backend, got 'train'",
        ),
        (
            lambda: run_world(2, _generator_fn),
            r"^run_world: fn='_generator_fn' is a generator or async function",
        ),
        (lambda: spawn_world(2, "train"), r"^spawn_world: fn must be a function"),
        (lambda: InMemoryWorld(2.0), r"^InMemoryWorld: world_size must be an int, got 2.0"),  # type: ignore[arg-type]
    ]
    for call, text in calls:
        with pytest.raises(ArgumentTypeError, match=text):
            call()
    with pytest.raises(ArgumentError, match=r"may_die=\[5\] names \[5\], not ranks of \[0, 2\)"):
        spawn_world(2, _rank, may_die=[5])
