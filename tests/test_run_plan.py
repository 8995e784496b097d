"""The run plan (``dtlab.core.plan.RunPlan``): one validated object, built once from the config or from
Python, that the Trainer and ``HybridShardedModel.from_plan`` read; ``strategy.model`` as the
data-parallel strategy with its old spellings translated; the precision policy's ``reduce_dtype``
reaching every strategy's dp reduction (bf16 halves the dp all-reduce bytes)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dtlab.config import load_config
from dtlab.core.plan import RunPlan
from dtlab.errors import ArgumentError, ConfigError
from dtlab.models import HybridShardedModel
from dtlab.models.precision import MixedPrecisionPolicy
from dtlab.parallel_config import builtin_model, run_plan
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import build_task

BASE = ["backend.name=inmemory", "backend.world_size=4", *TINY_LM, "model.n_layers=2"]

INVALID_PYTHON = [
    ({"data_parallel": "tensor"}, "data_parallel='tensor': the data-parallel strategy over the dp axis"),
    ({"tp": 0}, "tp must be an integer >= 1, got 0"),
    ({"dp": 0}, "dp must be an integer >= 1, got 0"),
    ({"schedule": "zb"}, "schedule='zb': choose one of gpipe, 1f1b"),
    ({"sequence_parallel": True}, "sequence_parallel=true needs tp > 1"),
    ({"tp": 2, "sequence_parallel": True, "tensor_plan": {"x": "colwise"}}, "selects the sequence-parallel"),
    ({"tensor_plan": {}}, "tensor_plan={}: give 'auto'"),
    ({"micro_batches": 4}, "micro_batches=4 applies to pipelines (pp > 1)"),
    ({"split_points": ("blocks.1",)}, "split_points=['blocks.1'] cuts pipeline stages, but pp=1"),
    ({"stages_per_rank": 2}, "stages_per_rank=2 applies to pipelines"),
    ({"pp": 2, "micro_batches": 1}, "micro_batches=1 is fewer than pp=2"),
    ({"pp": 2, "schedule": "interleaved_1f1b"}, "needs stages_per_rank >= 2"),
    ({"pp": 2, "schedule": "zero_bubble", "activation_checkpointing": True}, "zero-bubble defers"),
    ({"pp": 2, "split_points": ("a", "b")}, "2 stages need 1 distinct block names"),
]


@pytest.mark.parametrize(("kwargs", "needle"), INVALID_PYTHON, ids=[str(k) for k, _ in INVALID_PYTHON])
def test_a_plan_from_python_names_its_arguments(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ArgumentError) as info:
        RunPlan(**kwargs)
    assert needle in str(info.value), str(info.value)


def test_resolve_batch_and_blocks() -> None:
    plan = RunPlan("fsdp", pp=2, tp=2, micro_batches=4, split_points=["blocks.1"])  # type: ignore[arg-type]
    assert plan.split_points == ("blocks.1",) and plan.stages == 2 and not plan.resolved
    with pytest.raises(ArgumentError, match=r"needs dp: call plan\.resolve"):
        _ = plan.mesh_shape
    resolved = plan.resolve(8)
    assert resolved.mesh_shape == {"pp": 2, "dp": 2, "tp": 2} and resolved.class_name == "HybridShardedModel"
    assert resolved.describe() == "fsdp over dp 2 x tp 2 x pp 2 (1f1b, 4 micro-batches)"
    with pytest.raises(ArgumentError, match=r"tp=2 x pp=2 = 4 does not divide the world of 6 ranks"):
        plan.resolve(6)
    with pytest.raises(ArgumentError, match=r"dp=4 x tp=2 x pp=2 = 16 ranks, but the world has 8"):
        RunPlan(dp=4, tp=2, pp=2, micro_batches=2).resolve(8)
    resolved.check_batch(16)
    with pytest.raises(ArgumentError, match="global_batch=12 gives each of the 2 dp ranks 6 samples"):
        resolved.check_batch(12)
    with pytest.raises(ArgumentError, match="accumulation_steps=2 with pp=2"):
        resolved.check_batch(16, 2)
    resolved.check_blocks(["embed", "blocks.0", "blocks.1", "head"])
    with pytest.raises(ArgumentError, match=r"\['blocks.1'\] name no block"):
        resolved.check_blocks(["embed", "blocks.0", "head"])
    assert RunPlan("zero2").resolve(3).mesh_shape == {"pp": 1, "dp": 3, "tp": 1}
    assert not RunPlan("zero2").model_parallel and RunPlan("zero2").class_name == "zero2"


def test_the_config_builds_the_same_plan_and_names_its_fields() -> None:
    config = load_config(
        overrides=[*BASE, "backend.world_size=8", "parallel.tp=2", "parallel.pp=2", "strategy.model=fsdp"]
    )
    plan = run_plan(config, 8)
    assert plan == RunPlan("fsdp", pp=2, dp=2, tp=2)  # how messages name fields is not compared
    assert plan.name("tp") == "parallel.tp" and RunPlan().name("tp") == "tp"
    with pytest.raises(ConfigError, match=r"data.global_batch_size=10 gives each of the 2 dp ranks 5"):
        run_plan(
            config.model_copy(update={"data": config.data.model_copy(update={"global_batch_size": 10})}), 8
        )


@pytest.mark.parametrize(
    ("old", "optimizer", "new"),
    [
        ("tensor", None, "ddp"),
        ("pipeline", "zero1", "zero1"),
        ("hybrid", "zero3", "zero3"),
        ("HYBRID", None, "ddp"),
    ],
)
def test_old_spellings_of_strategy_model_warn_and_mean_the_data_parallel_strategy(
    old: str, optimizer: str | None, new: str
) -> None:
    extra = [f"strategy.optimizer={optimizer}"] if optimizer else []
    axis = "parallel.pp=2" if old == "pipeline" else "parallel.tp=2"
    with pytest.warns(
        FutureWarning, match=rf"strategy.model='{old.lower()}' is deprecated: .* write strategy.model={new}"
    ):
        config = load_config(overrides=[*BASE, f"strategy.model={old}", axis, *extra])
    assert config.strategy.model == new
    assert run_plan(config, 4).data_parallel == new
    with warnings.catch_warnings():  # the new spelling is quiet
        warnings.simplefilter("error")
        load_config(overrides=[*BASE, f"strategy.model={new}", axis, *extra])
    with pytest.raises(ConfigError, match=r"strategy.model='tensorx' is not allowed"):
        load_config(overrides=[*BASE, "strategy.model=tensorx"])


def test_the_models_own_declaration_decides_what_fits() -> None:
    """The config asks the built-in model (built on the meta device) for its tensor plan and blocks."""
    config = load_config(overrides=[*BASE, "parallel.pp=2"])
    module = builtin_model(config)
    assert all(p.is_meta for p in module.parameters())
    HybridShardedModel.check_plan(module, RunPlan(pp=2, split_points=("blocks.1",)))
    with pytest.raises(ArgumentError, match=r"\['blocks.7'\] name no block"):
        HybridShardedModel.check_plan(module, RunPlan(pp=2, split_points=("blocks.7",)))
    blocks = r"\['embed', 'blocks.0', 'blocks.1', 'head'\] \(\['blocks.7'\] name no block\)"
    config = load_config(overrides=[*BASE, "parallel.pp=2", "parallel.split_points=[blocks.7]"])
    with pytest.raises(ConfigError, match=r"parallel.split_points=\['blocks.7'\]: .* from " + blocks):
        build_task(config)  # when a run builds it: the config alone may be for a model of your own


def _build(backend: Any, plan: RunPlan, via_plan: bool) -> Any:
    from dtlab.core.rng import seeded_init
    from dtlab.zoo import TransformerLM

    with seeded_init(0):
        net = TransformerLM(32, 2, 2, 16)
    if via_plan:
        return HybridShardedModel.from_plan(net, backend, plan)
    from dtlab.backends import Mesh
    from dtlab.models import transformer_plan

    mesh = Mesh(backend, plan.resolve(backend.world_size).mesh_shape)
    return HybridShardedModel(net, mesh, plan.data_parallel, transformer_plan(), micro_batches=None)


def test_from_plan_builds_what_the_constructor_builds() -> None:
    plan = RunPlan("zero1", tp=2)

    def body(backend: Any) -> Any:
        a, b = _build(backend, plan, True), _build(backend, plan, False)
        same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
        from dtlab.backends import Mesh
        from dtlab.core.rng import seeded_init

        with seeded_init(1):  # never the global RNG unlocked: another rank may be building under seeded_init
            linear = torch.nn.Linear(2, 2)
        try:
            HybridShardedModel.from_plan(linear, Mesh(backend, {"dp": 4}), plan)
        except Exception as exc:
            refused = str(exc)
        return same, a.mesh.shape, type(a.dp_strategy).__name__, a.data_parallel, refused

    for same, shape, dp_class, name, refused in run_world(4, body, timeout=60):
        assert same and shape == {"pp": 1, "dp": 2, "tp": 2} and (dp_class, name) == ("ZeRO1Model", "zero1")
        assert "does not have the plan's sizes {'pp': 1, 'dp': 2, 'tp': 2}" in refused


@pytest.mark.parametrize("axis", ["parallel.tp=2", "parallel.pp=2"])
def test_reduce_dtype_of_the_precision_policy_halves_the_dp_all_reduce_bytes(axis: str) -> None:
    """``MixedPrecisionPolicy.reduce_dtype`` is what every strategy reduces in (the Trainer builds it
    from ``strategy.reduce_dtype``): bf16 sends half the bytes of fp32 over the dp axis (the gradients';
    a pipeline's check of unused parameters stays float32)."""
    from dtlab.trainers.build import build_model_strategy
    from dtlab.trainers.parallel import parallel_loss
    from dtlab.trainers.tasks import build_task, cross_entropy_loss

    config = load_config(
        overrides=[*BASE, axis, "parallel.micro_batches=2" if "pp" in axis else "parallel.dp=2"]
    )
    task = build_task(config)

    def body(backend: Any, policy: MixedPrecisionPolicy) -> tuple[int, Any]:
        model, _ = build_model_strategy(config, backend, task, precision=policy)
        loss_fn = parallel_loss(model, task.loss_fn, cross_entropy_loss, config.parallel.tp)
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (4, 32), generator=gen)
        dp = model.dp_backend
        dp.stats.reset()
        model.train_step((x, x.roll(1, 1)), loss_fn)
        return dp.stats["all_reduce"].bytes_sent, model.gradient_reducer.reduce_dtype  # type: ignore[attr-defined]

    full = run_world(4, body, MixedPrecisionPolicy(), timeout=60)
    half = run_world(4, body, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), timeout=60)
    assert all(b > 0 and d is None for b, d in full)
    counts = 8 * 2 * (2 - 1) if "pp" in axis else 0  # a pipeline's float32 unused counts, dp x pp of them
    assert [(2 * (b - counts), d) for b, d in half] == [(b - counts, torch.bfloat16) for b, _ in full]


def test_plan_and_tensor_plan_are_one_argument() -> None:
    """``TensorParallelModel(module, mesh, plan)`` and ``tensor_plan=`` (HybridShardedModel's name) are
    the same argument; given twice it is refused."""
    from dtlab.core.rng import seeded_init
    from dtlab.errors import ArgumentError
    from dtlab.models import TensorParallelModel
    from dtlab.zoo import TransformerLM

    def body(backend: Any) -> Any:
        built = []
        for kwargs in ({"plan": "auto"}, {"tensor_plan": "auto"}):
            with seeded_init(0):
                net = TransformerLM(32, 1, 2, 16)
            model = TensorParallelModel(net, backend, **kwargs)  # type: ignore[arg-type]
            built.append({n: (tuple(p.shape), model.placed(n)) for n, p in net.named_parameters()})
        try:
            TensorParallelModel(torch.nn.Linear(2, 2), backend, plan={"x": "colwise"}, tensor_plan="auto")
        except ArgumentError as exc:
            return built[0] == built[1] and len(built[0]) > 0, str(exc)
        return False, "not refused"

    for same, refused in run_world(2, body, timeout=60):
        assert same and "pass the plan once, as plan= or as tensor_plan=" in refused


def test_the_trainer_closes_its_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model-parallel run closes the groups of the mesh it built, on every rank, at its end."""
    from dtlab.backends import Mesh
    from dtlab.trainers import run_training

    closed: list[int] = []
    original = Mesh.close

    def close(mesh: Mesh) -> None:
        closed.append(mesh.backend.rank)
        original(mesh)

    monkeypatch.setattr(Mesh, "close", close)
    overrides = [*BASE, "backend.world_size=2", "parallel.tp=2", "train.steps=1", "train.eval_every=0"]
    run_training(load_config(overrides=[*overrides, "logging.progress=false", "logging.run_dir=null"]))
    assert sorted(closed) == [0, 1]


def test_advise_lays_out_the_model_it_prices() -> None:
    """``dtlab advise``'s parameter layout is read from ``TransformerLM`` itself (built on the meta
    device, its own tensor plan applied as tp rank 0 holds it): the same names in the same order,
    each tensor-parallel tensor 1/tp of its size, a tied head counted once (twice under a pipeline)."""
    from dtlab.advise.layout import transformer_tensors
    from dtlab.advise.spec import ModelSpec
    from dtlab.zoo import TransformerLM

    spec = ModelSpec(layers=3, hidden=64, heads=4, vocab=512, seq_len=16)
    with torch.device("meta"):
        whole = dict(TransformerLM(64, 3, 4, 16, vocab=512).named_parameters())
    one, two = transformer_tensors(spec, 1), transformer_tensors(spec, 2)
    assert [t.name for t in one] == [t.name for t in two] == list(whole)
    assert [t.numel for t in one] == [p.numel() for p in whole.values()]
    halves = {t.name for t, u in zip(one, two, strict=True) if u.numel * 2 == t.numel}
    assert {"tok.weight", "head.weight", "blocks.0.attn.qkv.weight", "blocks.2.mlp.2.weight"} <= halves
    assert "pos.weight" not in halves and "blocks.1.attn.proj.bias" not in halves
    assert {t.layer for t in one} == {-1, 0, 1, 2, 3} and one[-1].layer == 3 and one[0].unit == "<root>"
    tied = ModelSpec(layers=3, hidden=64, heads=4, vocab=512, seq_len=16, tied_embeddings=True)
    assert "head.weight" not in {t.name for t in transformer_tensors(tied, 2)}
    assert transformer_tensors(tied, 2, pipelined=True)[-1].name == "head.weight"
