"""Tensor parallelism's exact counts and checks: bytes per transformer block and for the loss (from
``backend.stats``), parameters per rank, clipping with mixed placements against one process's
``clip_grad_norm_``, the finite check across the mesh, and the plan errors (named before any work)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_tensor_helpers import (
    CFG,
    STEPS,
    batch,
    build,
    clip_reference,
    initial_state,
    max_rel_error,
    train_reference,
)

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Shard, placement_of
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import TensorParallelModel, transformer_plan
from dtlab.models.tensor import hugging_face_plan
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world
from dtlab.trainers.models import TransformerLM

F32 = 4


def bytes_world(backend: CommunicationBackend, n_layers: int, sp: bool) -> dict[str, dict[str, int]]:
    mesh = Mesh(backend, {"tp": backend.world_size})
    net = TransformerLM(**{**CFG, "n_layers": n_layers})  # type: ignore[arg-type]
    model = TensorParallelModel(net, mesh, plan=transformer_plan(sequence_parallel=sp))
    x, y = batch()
    mesh["tp"].stats.reset()
    model.cross_entropy(model(x), y).backward()
    return mesh["tp"].stats.snapshot()


def _expected(p: int, n_layers: int, sp: bool) -> dict[str, dict[str, int]]:
    b, s, h = 4, 8, CFG["d_model"]
    act = b * s * h * F32  # one (b, s, h) activation
    all_reduce = 2 * (p - 1) * act // p  # ring all-reduce, per rank
    half = (p - 1) * act // p  # all-gather or reduce-scatter of the same tensor
    loss = 3 * [2 * (p - 1) * b * s * F32 // p]  # max, target logit, sum of exp: one scalar per position
    # the tp ranks' agreement on the forward's inputs and on the loss's targets: 6 int64 each
    loss += 2 * [2 * (p - 1) * 6 * 8 // p]
    # after the first synchronized backward, the gradients of the parameters left whole (and not summed
    # over tp) compared over tp: 6 float64 per parameter (without sequence parallelism the position
    # embedding, per block 2 norms' weight and bias and 2 row biases, the final norm's weight and bias;
    # with it the position embedding alone), once
    compared = 1 if sp else 6 * n_layers + 3
    loss += [2 * (p - 1) * compared * 6 * 8 // p]
    if not sp:  # embedding forward, 4 per block (2 forward, 2 backward), the head's input in backward
        calls = [all_reduce] * (1 + 4 * n_layers + 1) + loss
        return {"all_reduce": {"calls": len(calls), "bytes_sent": sum(calls), "bytes_received": sum(calls)}}
    # per block: 4 all-gathers + 4 reduce-scatters; embedding RS forward + AG backward; head AG + RS;
    # positions: all-gather of their (s/p, h) gradient; norms and row biases: one all-reduce of grads
    ag = [half] * (4 * n_layers + 2) + [(p - 1) * (s // p) * h * F32]
    rs = [half] * (4 * n_layers + 2)
    partial = (6 * h * n_layers + 2 * h) * F32
    ar = [*loss, 2 * (p - 1) * partial // p]
    return {
        "all_gather": {"calls": len(ag), "bytes_sent": sum(ag), "bytes_received": sum(ag)},
        "all_reduce": {"calls": len(ar), "bytes_sent": sum(ar), "bytes_received": sum(ar)},
        "reduce_scatter": {"calls": len(rs), "bytes_sent": sum(rs), "bytes_received": sum(rs)},
    }


@pytest.mark.parametrize(("world", "sp"), [(2, False), (4, False), (2, True), (4, True)])
def test_exact_bytes_per_block_and_loss(world: int, sp: bool) -> None:
    for n_layers in (1, 2):
        got = run_world(world, bytes_world, n_layers, sp)
        want = _expected(world, n_layers, sp)
        for rank, stats in enumerate(got):
            assert stats == want, f"tp={world} sp={sp} layers={n_layers} rank {rank}: {stats} != {want}"


def memory_world(backend: CommunicationBackend) -> tuple[dict[str, Any], int, dict[str, int]]:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(TransformerLM(**CFG), mesh, plan=transformer_plan())  # type: ignore[arg-type]
    shapes = {n: (tuple(p.shape), placement_of(p)) for n, p in model.module.named_parameters()}
    local = sum(p.numel() * p.element_size() for p in model.module.parameters())
    return shapes, local, model.memory_report()


def test_split_layers_hold_one_tp_th_of_their_parameters() -> None:
    full = {n: tuple(p.shape) for n, p in TransformerLM(**CFG).named_parameters()}  # type: ignore[arg-type]
    for shapes, local, report in run_world(4, memory_world):
        assert report["parameters"] == local
        split = replicated = 0
        for name, (shape, placement) in shapes.items():
            n_full = torch.Size(full[name]).numel()
            if isinstance(placement, Shard):
                assert torch.Size(shape).numel() * 2 == n_full, name
                assert shape[placement.dim] * 2 == full[name][placement.dim], name
                split += n_full
            else:
                assert shape == full[name], name
                replicated += n_full
        assert local == (split // 2 + replicated) * F32
        assert split > 0.9 * (split + replicated)  # all but norms, positions and row biases


def clip_world(backend: CommunicationBackend, strategy: str, sp: bool, norm_type: float) -> dict[str, Any]:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(build(initial_state(), torch.float32), mesh, transformer_plan(sp))
    cls = DDPOptimizer if strategy == "ddp" else ZeRO1Optimizer
    opt = cls(model, torch.optim.SGD, lr=0.1)
    x, y = batch()
    c = mesh.coordinate("dp")
    model.cross_entropy(model(x.chunk(2)[c]), y.chunk(2)[c]).backward()
    norm = float(opt.clip_grad_norm_(0.05, norm_type))
    finite = opt.grads_are_finite()
    opt.step()
    return {"norm": norm, "finite": finite, "state": model.full_state_dict()}


@pytest.mark.parametrize(("strategy", "sp"), [("ddp", True), ("zero1", True), ("zero1", False)])
def test_clipping_with_mixed_placements_equals_one_process(strategy: str, sp: bool) -> None:
    for norm_type in (2.0, float("inf")):
        want, net = clip_reference(norm_type)
        for rank, out in enumerate(run_world(4, clip_world, strategy, sp, norm_type)):
            where = f"{strategy} sp={sp} norm_type={norm_type} rank {rank}"
            assert abs(out["norm"] - want) <= 1e-5 * want, f"{where}: norm {out['norm']} != {want}"
            assert out["finite"], where
            for k, v in net.state_dict().items():
                err = float((out["state"][k] - v).norm() / v.norm())
                assert err <= 1e-5, f"{where}: {k} relative error {err:.2e}"


def nonfinite_world(backend: CommunicationBackend) -> bool:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(build(initial_state(), torch.float32), mesh, transformer_plan())
    opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = batch()
    c = mesh.coordinate("dp")
    model.cross_entropy(model(x.chunk(2)[c]), y.chunk(2)[c]).backward()
    if backend.rank == 1:  # tp rank 1's shard: no other rank holds these elements
        model.module.blocks[0].mlp[0].weight.grad[0, 0] = float("nan")
    return opt.grads_are_finite()


def test_finite_check_spans_the_mesh() -> None:
    assert run_world(4, nonfinite_world) == [False] * 4


def plan_world(backend: CommunicationBackend, plan: Any, cfg: dict[str, int]) -> None:
    TensorParallelModel(TransformerLM(**cfg), Mesh(backend, {"tp": backend.world_size}), plan=plan)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world", "plan", "cfg", "message"),
    [
        (2, {"blocks.*.attention": "heads"}, CFG, r"pattern 'blocks\.\*\.attention' matches no module"),
        (3, {"blocks.*.attn": "heads"}, CFG, r"'blocks\.0\.attn'.*attention heads is 4.*tp=3"),
        (3, {"blocks.*.mlp.0": "colwise"}, CFG, r"'blocks\.0\.mlp\.0'.*out_features.*128.*tp=3"),
        (3, {"blocks.*.mlp.2": "rowwise"}, CFG, r"'blocks\.0\.mlp\.2'.*in_features is 128.*tp=3"),
        (3, {"tok": "vocab"}, CFG, r"'tok'.*vocabulary \(num_embeddings\) is 256.*tp=3.*pad"),
        (2, {"tok": "colwise"}, CFG, r"ColwiseParallel applies to a Linear.*'tok' is a SmallInitEmbedding"),
        (2, {"head": "diagonal"}, CFG, r"'head': unknown style 'diagonal'"),
        (2, {"blocks.*.attn": "heads", "blocks.*.attn.qkv": "colwise"}, CFG, r"'blocks\.0\.attn' is swapped"),
        (2, {"blocks.*.mlp": "heads"}, CFG, r"int attribute 'n_heads'"),
        (2, {}, CFG, r"needs a plan"),
    ],
)
def test_plan_errors_name_module_size_and_tp(
    world: int, plan: Any, cfg: dict[str, int], message: str
) -> None:
    with pytest.raises(RankFailedError, match=message) as info:
        run_world(world, plan_world, plan, cfg)
    assert isinstance(info.value.__cause__, StrategyError)


def buffer_bias_world(backend: CommunicationBackend) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    bias = net[2].bias.detach().clone()
    del net[2].bias
    net[2].register_buffer("bias", bias)  # a fixed offset: a buffer, not a parameter
    TensorParallelModel(net, Mesh(backend, {"tp": 2}), plan={"0": "colwise", "2": "rowwise"})


def test_a_buffer_bias_in_the_plan_is_named_before_any_swap() -> None:
    with pytest.raises(RankFailedError, match=r"module '2': its 'bias' is a buffer.*nn.Parameter") as info:
        run_world(2, buffer_bias_world)
    assert isinstance(info.value.__cause__, StrategyError)


def test_mesh_without_tp_and_wrong_optimizer_pairing() -> None:
    def no_tp(backend: CommunicationBackend) -> None:
        TensorParallelModel(TransformerLM(**CFG), Mesh(backend, {"dp": 2}), transformer_plan())  # type: ignore[arg-type]

    with pytest.raises(RankFailedError, match=r"needs a mesh with a 'tp' axis"):
        run_world(2, no_tp)

    def rs_with_ddp(backend: CommunicationBackend) -> None:
        mesh = Mesh(backend, {"tp": 2})
        net = TransformerLM(**CFG)  # type: ignore[arg-type]
        model = TensorParallelModel(net, mesh, transformer_plan(), gradient_sync="reduce_scatter")
        DDPOptimizer(model, torch.optim.SGD, lr=0.1)

    with pytest.raises(RankFailedError, match=r"DDPOptimizer cannot step; use ZeRO1Optimizer"):
        run_world(2, rs_with_ddp)


def compressed_world(backend: CommunicationBackend) -> tuple[dict[str, torch.Tensor], int, int]:
    from dtlab.compression import Dense
    from dtlab.optimizers import GradientCompressionOptimizer

    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(build(initial_state(), torch.float32), mesh, transformer_plan(True))
    opt = GradientCompressionOptimizer(DDPOptimizer(model, torch.optim.SGD, lr=0.5, momentum=0.9), Dense())
    x, y = batch()
    c = mesh.coordinate("dp")
    mesh["dp"].stats.reset()
    for _ in range(STEPS):
        model.cross_entropy(model(x.chunk(2)[c]), y.chunk(2)[c]).backward()
        opt.step()
        opt.zero_grad()
    local = sum(p.numel() for p in model.module.parameters())
    return model.full_state_dict(), mesh["dp"].stats.bytes_sent, local


def test_compression_acts_on_the_dp_axis() -> None:
    """GradientCompressionOptimizer swaps the reducer over mesh['dp']: Dense equals the plain run, and
    the dp group carries this rank's shards' gradients (one bucket; 2(P-1)/P = 1 of them at P=2)."""
    ref = train_reference("sgd")[1]
    for rank, (state, sent, local) in enumerate(run_world(4, compressed_world)):
        assert max_rel_error(state, ref) <= 1e-5, f"rank {rank}"
        assert sent == STEPS * (local + local % 2) * F32, f"rank {rank}: {sent} bytes"


def test_the_model_declares_its_plan() -> None:
    """``transformer_plan()`` asks the module for its own ``tp_plan()`` (dtlab's TransformerLM declares
    one, as a user's model may); a module declaring none is refused, naming the method."""
    lm = TransformerLM(**CFG)  # type: ignore[arg-type]
    assert set(lm.tp_plan(sequence_parallel=True)) >= {"tok", "blocks.*.attn", "head", "ln_f", "pos"}

    def undeclared(backend: CommunicationBackend) -> None:
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        TensorParallelModel(net, Mesh(backend, {"tp": 2}), transformer_plan())

    with pytest.raises(RankFailedError, match=r"Sequential declares no tensor plan \(a tp_plan\(") as info:
        run_world(2, undeclared)
    assert isinstance(info.value.__cause__, StrategyError)
    assert "(dtlab train: parallel.plan)" in str(info.value) and "its nn.Linear layers: ['0', '1']" in str(
        info.value
    )


def test_a_plan_only_in_the_config_is_read_under_the_base_model_prefix() -> None:
    """Hugging Face models whose plan is only in ``config.base_model_tp_plan`` (no ``tp_plan`` or
    ``_tp_plan`` on the model, as in older transformers): its patterns name the base model's modules, so
    a model holding the base model under ``base_model_prefix`` gets them under that prefix."""
    config = SimpleNamespace(base_model_tp_plan={"layers.*.up": "colwise"})
    base = torch.nn.Module()
    base.config = config
    base.base_model_prefix = "model"
    outer = torch.nn.Module()
    outer.config, outer.base_model_prefix, outer.model = config, "model", base
    assert hugging_face_plan(outer) == {"model.layers.*.up": "colwise"}
    assert hugging_face_plan(base) == {"layers.*.up": "colwise"}
    assert hugging_face_plan(torch.nn.Linear(2, 2)) is None
