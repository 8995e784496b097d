"""Hybrid checkpoints across meshes: the model and optimizer shards saved at 2 x 2 x 2 (FSDP on dp,
tensor and pipeline parallel) load at pp=4, into FSDP at dp=4 and into DDP at 2 ranks with identical
parameters, and training continues as the uninterrupted run does; the plain module's tensors come out
of the shards (what ``dtlab consolidate`` writes). A tied embedding saved at tp=2 or under ZeRO-3
resumes at pp=2 (its copy on the last stage, with its AdamW state) as one process continues."""

from __future__ import annotations

import copy
from typing import Any

import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model
from test_tensor_helpers import OPTIMIZERS, batch, build, max_rel_error

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError
from dtlab.models import DDPModel, FSDPModel, HybridShardedModel, ModuleClassPolicy
from dtlab.models.base import ModelStrategy
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.testing import run_world
from dtlab.trainers.models import Block
from dtlab.zoo.builtin import TransformerLM

CUBE = {"pp": 2, "dp": 2, "tp": 2}
SAVED_AFTER = 2


def _step(model: ModelStrategy, opt: OptimizerStrategy, dp: int, coord: int) -> None:
    x, y = batch()
    x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
    cross_entropy = getattr(model, "cross_entropy", None)
    if hasattr(model, "mesh"):
        model.train_step((x, y), cross_entropy or _plain_ce)
    else:
        _plain_ce(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _plain_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def save_world(backend: CommunicationBackend) -> dict[str, Any]:
    """2 steps at 2 x 2 x 2, the shards, then one more step (the uninterrupted continuation)."""
    cls, kwargs, dtype = OPTIMIZERS["adamw"]
    model = hybrid_model(backend, CUBE, "fsdp", dtype, sequence_parallel=True, micro_batches=2)
    opt = ZeRO3Optimizer(model, cls, **kwargs)
    dp, coord = model.mesh.size("dp"), model.mesh.coordinate("dp")
    for _ in range(SAVED_AFTER):
        _step(model, opt, dp, coord)
    saved = {
        "model": model.sharded_state_dict(),
        "optim": opt.sharded_state_dict(),
        "full": model.full_state_dict(),
    }
    _step(model, opt, dp, coord)
    saved["continued"] = model.full_state_dict()
    return saved


def load_world(
    backend: CommunicationBackend,
    where: str,
    model_shards: list[ShardedState],
    optim_shards: list[ShardedState],
) -> dict[str, Any]:
    """Load at another mesh or strategy; the loaded full state and the state after one more step."""
    cls, kwargs, dtype = OPTIMIZERS["adamw"]
    net = build(None, dtype)
    model: ModelStrategy
    if where == "pp4":
        mesh = Mesh(backend, {"pp": 4})
        model = hybrid_model(mesh, {"pp": 4}, "ddp", dtype, micro_batches=4)
        opt: OptimizerStrategy = DDPOptimizer(model, cls, **kwargs)
        dp, coord = 1, 0
    elif where == "fsdp_dp4":
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((Block,)))
        opt = ZeRO3Optimizer(model, cls, **kwargs)
        dp, coord = backend.world_size, backend.rank
    else:
        model = DDPModel(net, backend)
        opt = DDPOptimizer(model, cls, **kwargs)
        dp, coord = backend.world_size, backend.rank
    model.load_sharded_state_dict(model_shards)
    opt.load_sharded_state_dict(optim_shards)
    loaded = model.full_state_dict()
    _step(model, opt, dp, coord)
    return {"loaded": loaded, "continued": model.full_state_dict()}


def test_a_cube_checkpoint_loads_at_other_meshes_and_strategies() -> None:
    saved = run_world(8, save_world, timeout=120)
    model_shards = [s["model"] for s in saved]
    optim_shards = [s["optim"] for s in saved]
    full, continued = saved[0]["full"], saved[0]["continued"]
    for s in saved[1:]:
        assert all(torch.equal(s["full"][k], v) for k, v in full.items())
    # the plain module's tensors, as dtlab consolidate writes them
    plain = full_tensors_from_shards(model_shards)
    assert plain.keys() == full.keys() and all(torch.equal(plain[k], full[k]) for k in full)
    net = build(None, torch.float64)
    net.load_state_dict(plain)
    for where, world in (("pp4", 4), ("fsdp_dp4", 4), ("ddp2", 2)):
        for rank, out in enumerate(
            run_world(world, load_world, where, model_shards, optim_shards, timeout=120)
        ):
            assert out["loaded"].keys() == full.keys()
            for k, v in full.items():
                assert torch.equal(out["loaded"][k], v), f"{where} rank {rank}: {k} differs after loading"
            err = max_rel_error(out["continued"], continued)
            assert err <= 1e-5, f"{where} rank {rank}: continuation relative error {err:.2e}"


TIED_STEPS = 3


def _tied_lm() -> torch.nn.Module:
    net = TransformerLM(d_model=16, n_layers=2, n_heads=2, seq_len=8, vocab=32, tie_embeddings=True).double()
    with torch.no_grad():  # the same values on every rank and in the reference, whatever the RNG
        for i, p in enumerate(net.parameters()):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=p.dtype)
            p.copy_(noise * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return net


def _tied_batch() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(7))
    return t[:, :-1], t[:, 1:]


def _tied_groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    named = dict(module.named_parameters())  # a tied weight once, under its first name
    decay = [p for n, p in named.items() if p.dim() > 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in named.values() if p.dim() < 2]}]


def _tied_world(
    backend: CommunicationBackend, shape: dict[str, int], dp: str, saved: list[Any] | None, regroup: str = ""
) -> dict[str, Any]:
    """At ``shape`` under ``dp``: train, or load ``saved`` and train one step more (``regroup``: the
    param groups in the other order, or a third group split off; refused: the error's text)."""
    mesh = Mesh(backend, shape)
    pipe = {"micro_batches": 2} if shape.get("pp", 1) > 1 else {}
    plan = "auto" if shape.get("tp", 1) > 1 else None
    model = hybrid_model_of(_tied_lm(), mesh, dp, plan, pipe)
    groups = _tied_groups(model.module)
    if regroup == "swap":
        groups = groups[::-1]
    elif regroup == "split":
        groups = [
            {"params": groups[0]["params"][:1]},
            {**groups[0], "params": groups[0]["params"][1:]},
            groups[1],
        ]
    opt = OPTIMIZER_OF[dp](model, torch.optim.AdamW(groups, lr=0.01, weight_decay=0.0))
    if saved is not None:
        model.load_sharded_state_dict([m for m, _ in saved])
        try:
            opt.load_sharded_state_dict([o for _, o in saved])
        except CheckpointError as exc:
            return {"refused": str(exc)}
    x, y = _tied_batch()
    n, coord = mesh.size("dp"), mesh.coordinate("dp")
    for _ in range(1 if saved is not None else TIED_STEPS - 1):
        model.train_step((x.chunk(n)[coord], y.chunk(n)[coord]), model.cross_entropy)
        opt.step()
        opt.zero_grad()
    return {"shards": (model.sharded_state_dict(), opt.sharded_state_dict()), "full": model.full_state_dict()}


def hybrid_model_of(net: torch.nn.Module, mesh: Mesh, dp: str, plan: Any, pipe: dict[str, Any]) -> Any:
    extra = {"persistence_threshold": 0} if dp == "zero3" else {}
    return HybridShardedModel(net, mesh, dp, tensor_plan=plan, **pipe, **extra)


def test_a_tied_embedding_saved_without_a_pipeline_resumes_at_pp2() -> None:
    """The head's copy of the tied embedding on the last stage (and its AdamW moments and step) comes
    from the single entry a tp or ZeRO-3 checkpoint holds: before, a CheckpointError ('no entry for
    head.weight') from ZeRO-3's, and from tp's the copy's optimizer state silently started fresh."""
    net = _tied_lm()
    ref = torch.optim.AdamW(_tied_groups(net), lr=0.01, weight_decay=0.0)
    x, y = _tied_batch()
    for _ in range(TIED_STEPS):
        _plain_ce(net(x), y).backward()
        ref.step()
        ref.zero_grad()
    want = net.state_dict()
    for shape, dp in (({"tp": 2}, "ddp"), ({"dp": 2}, "zero3")):
        saved = [r["shards"] for r in run_world(2, _tied_world, shape, dp, None, timeout=120)]
        for rank, out in enumerate(run_world(2, _tied_world, {"pp": 2}, "zero1", saved, timeout=120)):
            err = max_rel_error(out["full"], want)
            assert err <= 1e-10, f"{shape} {dp} -> pp2, rank {rank}: relative error {err:.2e}"


def test_param_groups_built_otherwise_are_refused_on_resume() -> None:
    """Saved groups' options apply by position: groups built in another order (no-decay first) at tp=2
    would silently swap the weight decays of the two groups, a third group would silently keep its
    constructor's options (no scheduled lr); every rank refuses naming the fix."""
    saved = [r["shards"] for r in run_world(2, _tied_world, {"dp": 2}, "zero1", None, timeout=120)]
    for out in run_world(2, _tied_world, {"tp": 2}, "ddp", saved, "swap", timeout=120):
        assert "is in another param group than when the checkpoint was written" in out.get("refused", ""), out
        assert "Build the param groups as when saving" in out["refused"]
    for out in run_world(2, _tied_world, {"tp": 2}, "ddp", saved, "split", timeout=120):
        assert "has 2 param group(s), this one 3" in out.get("refused", ""), out


def _precision_world(
    backend: CommunicationBackend, dtype: torch.dtype, saved: list[Any] | None
) -> dict[str, Any]:
    """ZeRO-1 over 2 ranks on a ``dtype`` model: one AdamW step; or DDP loading ``saved``: one more."""
    model = hybrid_model_of(
        _tied_lm().to(dtype), Mesh(backend, {"dp": backend.world_size}), "zero1", None, {}
    )
    opt = OPTIMIZER_OF["zero1"](model, torch.optim.AdamW, lr=0.01)
    if saved is not None:
        model.load_sharded_state_dict([s["shards"][0] for s in saved])
        opt.load_sharded_state_dict([s["shards"][1] for s in saved])
    x, y = _tied_batch()
    n, coord = backend.world_size, backend.rank
    model.train_step((x.chunk(n)[coord], y.chunk(n)[coord]), model.cross_entropy)
    opt.step()
    opt.zero_grad()
    dtypes = {v.dtype for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"}
    return {"shards": (model.sharded_state_dict(), opt.sharded_state_dict()), "dtypes": dtypes}


def test_optimizer_state_of_a_bf16_model_resumes_into_a_float64_one() -> None:
    """Optimizer state takes the parameters' dtype on load, as torch's load_state_dict does: before,
    AdamW's moments stayed bfloat16 beside float64 parameters and the first step raised a raw
    RuntimeError (expected dtype c10::BFloat16 for `end`)."""
    saved = run_world(2, _precision_world, torch.bfloat16, None, timeout=120)
    assert saved[0]["dtypes"] == {torch.bfloat16}
    for out in run_world(1, _precision_world, torch.float64, saved, timeout=120):
        assert out["dtypes"] == {torch.float64}


def _stage_groups_world(
    backend: CommunicationBackend, saved: list[Any] | None, steps: int, pp: int = 2
) -> dict[str, Any]:
    """pp=2 (or ``pp``) under ZeRO-1, param groups built per stage from the stage's own parameters, an
    empty group dropped (the embeddings' group, with its own lr, exists on stage 0 only): ``steps``
    steps, after loading ``saved`` (refused: the error's text) when given."""
    mesh = Mesh(backend, {"pp": pp})
    net = TransformerLM(d_model=16, n_layers=2, n_heads=2, seq_len=8, vocab=32, tie_embeddings=False).double()
    net.load_state_dict(_tied_lm().state_dict())  # the same values on every rank
    model = HybridShardedModel(net, mesh, "zero1", micro_batches=2)
    named = model.trainable_parameters()
    emb = [p for n, p in named if n.startswith(("tok.", "pos."))]
    rest = [(n, p) for n, p in named if not n.startswith(("tok.", "pos."))]
    groups = [
        {"params": emb, "lr": 0.02},
        {"params": [p for _, p in rest if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in rest if p.dim() < 2]},
    ]
    opt = OPTIMIZER_OF["zero1"](model, torch.optim.AdamW([g for g in groups if g["params"]], lr=0.01))
    if saved is not None:
        model.load_sharded_state_dict([m for m, _ in saved])
        try:
            opt.load_sharded_state_dict([o for _, o in saved])
        except CheckpointError as exc:
            return {"refused": str(exc)}
    x, y = _tied_batch()
    for _ in range(steps):
        model.train_step((x, y), model.cross_entropy)
        opt.step()
        opt.zero_grad()
    return {"shards": (model.sharded_state_dict(), opt.sharded_state_dict()), "full": model.full_state_dict()}


def test_stages_with_different_numbers_of_param_groups_resume_exactly_at_pp2() -> None:
    """Each stage's optimizer saved its own groups (3 on stage 0, 2 on stage 1): each stage checks and
    applies its own, so a resume at the same layout continues as one run (before, every stage was
    checked against stage 0's groups: stage 1 refused while stage 0 went on into a collective). At
    pp=1 the groups are built alike (3): each parameter keeps its options, though stage 1 numbered its
    groups its own way (before: refused, "'head.weight' ... group 0 when saved, group 1 here")."""
    whole = run_world(2, _stage_groups_world, None, 3, timeout=120)
    saved = [r["shards"] for r in run_world(2, _stage_groups_world, None, 2, timeout=120)]
    for rank, out in enumerate(run_world(2, _stage_groups_world, saved, 1, timeout=120)):
        assert "refused" not in out, (rank, out)
        err = max_rel_error(out["full"], whole[rank]["full"])
        assert err == 0.0, f"rank {rank}: relative error {err:.2e}"
    out = run_world(1, _stage_groups_world, saved, 1, 1, timeout=120)[0]
    assert "refused" not in out, out
    assert max_rel_error(out["full"], whole[0]["full"]) <= 1e-12


def test_a_malformed_param_group_of_one_stage_is_refused_on_every_rank() -> None:
    """At pp > 1 each stage checks its own saved param groups: one stage's that cannot apply (a string
    lr, not a list) is refused on every rank, not by that stage alone while the other waits in the next
    collective (before: CollectiveTimeoutError 'can never complete' in memory, a hang on a backend)."""
    saved = [r["shards"] for r in run_world(2, _stage_groups_world, None, 1, timeout=120)]
    for junk in ("fast", None):
        bad = []
        for rank, (m, o) in enumerate(saved):
            md = copy.deepcopy(o.metadata)
            if rank == 1 and junk is None:
                md["param_groups"] = "junk"
            elif rank == 1:
                md["param_groups"][0]["lr"] = junk
            bad.append((m, ShardedState(o.tensors, md)))
        said = [out.get("refused", "") for out in run_world(2, _stage_groups_world, bad, 1, timeout=120)]
        assert "saved for another rank (pipeline stage) do not fit" in said[0], said
        assert ("param_groups[0].lr='fast'" if junk else "param_groups='junk'") in said[1], said
