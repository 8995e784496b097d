"""A torch user's habits under tensor parallelism (tp=2 and dp2 x tp2, 4 in-memory ranks, DDPOptimizer
and ZeRO1Optimizer): each equals one process on the global batch after 3 SGD steps, or is refused
naming the fix. torch's ``clip_grad_norm_`` over ``model.parameters()`` under DDPOptimizer used to take
each tp rank's partial norm (max abs error 4.3e-4 after 3 steps, tp ranks clipped differently); it is
now refused naming ``opt.clip_grad_norm_``. Also: eval() with dropout gives the plain module's output,
and ``sum(p.numel() for p in model.parameters())`` counts this rank's pieces (full_state_dict: all)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from steps import outcome, plain_steps
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.models.tensor import ColwiseParallel, RowwiseParallel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world

STEPS, LR = 3, 0.1
PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "head": ColwiseParallel(gather_output=True)}


class Net(nn.Module):
    """A replicated input layer, a column/row-parallel block (optionally in a checkpoint) with a
    residual, a column-parallel head gathering its output (optionally in a checkpoint)."""

    def __init__(self, block: bool | None = None, last: bool | None = None, drop: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(drop)
        self.emb, self.fc1 = nn.Linear(8, 16), nn.Linear(16, 32)
        self.fc2, self.head = nn.Linear(32, 16), nn.Linear(16, 4)
        self.reentrant_block, self.reentrant_last = block, last

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        r = self.reentrant_block
        h = h + (self.block(h) if r is None else checkpoint(self.block, h, use_reentrant=r))
        r = self.reentrant_last
        return self.head(h) if r is None else checkpoint(self.head, h, use_reentrant=r)


def build(**kw: Any) -> Net:
    net = Net(**kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return net


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def train(model: nn.Module, opt: torch.optim.Optimizer, habit: str, dp: int = 1, c: int = 0) -> None:
    """STEPS steps on this replica's part of each global batch, with one habit."""
    sync: Callable[[], Any] = getattr(model, "no_sync", contextlib.nullcontext)
    for s in range(STEPS):
        x, y = (t.chunk(dp)[c] for t in data(s))
        if habit == "accumulate":  # 2 micro-batches, the first inside no_sync()
            with sync():
                (F.cross_entropy(model(x[: len(x) // 2]), y[: len(y) // 2]) / 2).backward()
            (F.cross_entropy(model(x[len(x) // 2 :]), y[len(y) // 2 :]) / 2).backward()
        else:
            if habit == "eval":  # inference between steps: eval() + no_grad(), then train()
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            F.cross_entropy(model(x), y).backward()
        if habit == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad(set_to_none=habit != "zero_keep")


def reference(habit: str, **kw: bool | None) -> dict[str, torch.Tensor]:
    net = build(**kw)
    train(net, torch.optim.SGD(net.parameters(), lr=LR), habit)
    return net.state_dict()


CASES: list[tuple[str, dict[str, bool | None]]] = [
    ("plain", {"block": True}),  # reentrant checkpoint around the column/row-parallel block
    ("plain", {"block": False}),
    ("plain", {"last": True}),  # around the last (column-parallel) layer, whose gradients come first
    ("eval", {}),
    ("zero_keep", {}),  # zero_grad(set_to_none=False)
    ("accumulate", {}),
]


def habits_world(backend: CommunicationBackend, shape: dict[str, int]) -> dict[str, Any]:
    mesh = Mesh(backend, shape)
    dp, c = mesh.size("dp"), mesh.coordinate("dp")
    out: dict[str, Any] = {}
    for strategy in (DDPOptimizer, ZeRO1Optimizer):
        for habit, kw in CASES:
            model = TensorParallelModel(build(**kw), mesh, plan=PLAN)
            train(model, strategy(model, torch.optim.SGD, lr=LR), habit, dp, c)
            out[f"{strategy.__name__}/{habit}/{kw}"] = model.full_state_dict()
    # clipping under DDPOptimizer: torch's clip_grad_value_ is element-wise, right on each piece
    model = TensorParallelModel(build(), mesh, plan=PLAN)
    train(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), "clip_value", dp, c)
    out["clip_value"] = model.full_state_dict()
    # torch's clip_grad_norm_ would take this rank's partial norm: refused; opt.clip_grad_norm_ is right
    model = TensorParallelModel(build(), mesh, plan=PLAN)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    x, y = (t.chunk(dp)[c] for t in data(0))
    F.cross_entropy(model(x), y).backward()
    out["torch_norm"] = outcome(torch.nn.utils.clip_grad_norm_, model.parameters(), 0.05)
    grad = model.module.fc1.weight.grad
    assert grad is not None
    out["piece"] = (tuple(grad.shape), float(grad[0, 0]), grad.clone().shape)  # element-wise use works
    out["norm"] = float(opt.clip_grad_norm_(0.05))
    opt.step()
    out["clipped"] = model.full_state_dict()
    # eval() with dropout: the plain module's eval output; train() reaches the module again
    model = TensorParallelModel(build(drop=0.5), mesh, plan=PLAN)
    model.eval()
    with torch.no_grad():
        out["eval_out"] = model(data(0)[0])
    model.train()
    out["train_again"] = model.module.drop.training
    # counting parameters: this rank's pieces; the full count from full_state_dict()
    out["count"] = (
        sum(p.numel() for p in model.parameters()),
        sum(v.numel() for v in model.full_state_dict().values()),
    )
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert err <= 1e-5, f"{where}: max abs error {err:.2e}"


def test_torch_habits_equal_one_process_or_are_refused() -> None:
    torch.set_num_threads(1)
    refs = {f"{h}/{kw}": reference(h, **kw) for h, kw in CASES}
    clip_value = reference("clip_value")
    net = build()
    x, y = data(0)
    F.cross_entropy(net(x), y).backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05))
    torch.optim.SGD(net.parameters(), lr=LR).step()
    with torch.no_grad():
        eval_out = build(drop=0.5).eval()(x)
    n_full = sum(p.numel() for p in net.parameters())
    split = ("fc1.weight", "fc1.bias", "fc2.weight", "head.weight", "head.bias")
    want_local = n_full - sum(p.numel() // 2 for n, p in net.named_parameters() if n in split)
    for shape in ({"tp": 2}, {"dp": 2, "tp": 2}):
        world = 2 * shape.get("dp", 1)
        for rank, out in enumerate(run_world(world, habits_world, shape, timeout=120)):
            where = f"{shape} rank {rank}"
            for name in (DDPOptimizer.__name__, ZeRO1Optimizer.__name__):
                for case, ref in refs.items():
                    _close(out[f"{name}/{case}"], ref, f"{where} {name}/{case}")
            _close(out["clip_value"], clip_value, f"{where} clip_grad_value_")
            assert "opt.clip_grad_norm_" in out["torch_norm"], f"{where}: {out['torch_norm']}"
            assert out["piece"][0] == out["piece"][2] == (16, 16), where
            assert abs(out["norm"] - want_norm) <= 1e-5 * want_norm, f"{where}: {out['norm']} != {want_norm}"
            _close(out["clipped"], net.state_dict(), f"{where} opt.clip_grad_norm_")
            assert float((out["eval_out"] - eval_out).abs().max()) <= 1e-5 and out["train_again"], where
            assert out["count"] == (want_local, n_full), f"{where}: {out['count']}"


def pipeline_world(
    backend: CommunicationBackend, torch_clip: bool
) -> tuple[float | str, dict[str, torch.Tensor]]:
    """pp=2 under DDP: one step of the built-in transformer clipped by torch's clip_grad_norm_ over
    model.parameters() (each rank holds only its stage's: refused) or by opt.clip_grad_norm_."""
    from hybrid_cases import hybrid_model
    from test_tensor_helpers import batch

    model = hybrid_model(backend, {"pp": 2}, "ddp", micro_batches=2)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
    model.train_step(batch(), model.cross_entropy)
    try:
        if torch_clip:
            norm: float | str = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        else:
            norm = float(opt.clip_grad_norm_(0.05))
    except StrategyError as exc:
        return str(exc), {}
    opt.step()
    return norm, model.full_state_dict()


def test_torch_clip_grad_norm_on_a_pipeline_rank_is_refused() -> None:
    """Before: each stage clipped by its own norm (0.091 and 0.230 against one process's 0.247)."""
    from test_tensor_helpers import clip_reference

    torch.set_num_threads(1)
    want, net = clip_reference(2.0)
    for rank, (norm, _) in enumerate(run_world(2, pipeline_world, True, timeout=60)):
        assert isinstance(norm, str) and "opt.clip_grad_norm_" in norm, f"rank {rank}: {norm}"
    for rank, (norm, state) in enumerate(run_world(2, pipeline_world, False, timeout=60)):
        assert isinstance(norm, float) and abs(norm - want) <= 1e-5 * want, f"rank {rank}: {norm} != {want}"
        _close(state, net.state_dict(), f"pp=2 rank {rank} opt.clip_grad_norm_")


def saved_on_rank_0(backend: CommunicationBackend, pp: bool) -> str:
    """``if rank == 0: torch.save(model.state_dict(), path)`` under tp=2 or pp=2: rank 1 goes its way."""
    from dtlab.models import PipelineParallelModel

    backend.check_collectives = False  # a user's default
    mesh = Mesh(backend, {"pp" if pp else "tp": 2})
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = (
        PipelineParallelModel(net, mesh, micro_batches=2)
        if pp
        else TensorParallelModel(build(), mesh, plan=PLAN)
    )
    if backend.rank != 0:
        return "left"
    try:
        model.state_dict()
    except StrategyError as exc:
        return str(exc)
    return "saved"


def test_state_dict_on_one_rank_names_the_fix() -> None:
    """Rank 0 saving alone under tp or pp gathers from ranks that never come: it stopped with the
    backend's bare collective timeout (on Gloo after 300 s); that error now names the fix."""
    for pp in (False, True):
        said = run_world(2, saved_on_rank_0, pp, timeout=60)[0]
        assert "every rank must call it" in said and "if rank == 0: torch.save(sd, path)" in said, said


def pruned_after_wrapping(backend: CommunicationBackend) -> list[str]:
    """torch.nn.utils.prune on model.module after wrapping (tp=2): the state dict, then a step."""
    import torch.nn.utils.prune as prune

    model = TensorParallelModel(build(), Mesh(backend, {"tp": 2}), plan=PLAN)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    prune.l1_unstructured(model.module.fc1, "weight", amount=0.5)
    x, y = data(0)
    said = [outcome(model.state_dict), outcome(plain_steps, model, opt, [(x, y)], F.cross_entropy)]
    model = TensorParallelModel(build(), Mesh(backend, {"tp": 2}), plan=PLAN)  # a parametrization now
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    torch.nn.utils.parametrizations.orthogonal(model.module.fc1)  # of this rank's slice
    return [*said, outcome(plain_steps, model, opt, [(x, y)], F.cross_entropy)]


def pruned_on_one_stage(backend: CommunicationBackend) -> str:
    """pp=2: a layer of stage 0 pruned after wrapping (it is on pipeline rank 0 only), then
    model.state_dict() on every rank."""
    import torch.nn.utils.prune as prune

    from dtlab.models import PipelineParallelModel

    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = PipelineParallelModel(net, Mesh(backend, {"pp": 2}), micro_batches=2)
    if backend.rank == 0:
        prune.l1_unstructured(model.module.get_submodule("0"), "weight", amount=0.5)
    try:
        model.state_dict()
    except StrategyError as exc:
        return str(exc)
    return "saved"


def test_pruning_after_wrapping_a_tensor_parallel_model_is_refused() -> None:
    """Pruning renames weight to weight_orig and weight_mask, and on a split layer computes the mask
    from this rank's slice (not torch's mask): model.state_dict() stopped with a raw KeyError
    'fc1.weight' and training went on with the slice's masks (and the checkpoint wrote each slice
    as a whole tensor). Both now name the change and the fix; so does a parametrization registered
    after wrapping (orthogonal() of a slice trained on silently)."""
    for said in run_world(2, pruned_after_wrapping, timeout=60):
        assert "it has ['fc1.parametrizations.weight'] instead" in said[2], said[2]
        for text in said[:2]:
            assert "no longer has ['fc1.weight']" in text and "before wrapping" in text, text
        assert said[1].startswith("TensorParallelModel: "), said[1]
    # a stage's own change: the other pipeline rank waited in the state gather (the backend's timeout),
    # then said 'every rank must call it'; now it refuses at once, naming where
    first, other = run_world(2, pruned_on_one_stage, timeout=60)
    assert "no longer has ['0.weight']" in first, first
    assert "on pipeline rank(s) [0] was renamed" in other and "before wrapping" in other, other


def pruned_after_steps(backend: CommunicationBackend) -> list[str]:
    """tp=2: three clean steps, a forward pre-hook of the user's (nothing renamed), then prune: each
    step's outcome."""
    import torch.nn.utils.prune as prune

    model = TensorParallelModel(build(), Mesh(backend, {"tp": 2}), plan=PLAN)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    said = []
    for step in range(5):
        if step == 3:
            model.module.fc2.register_forward_pre_hook(lambda *_: None)
        if step == 4:
            prune.l1_unstructured(model.module.fc2, "weight", amount=0.5)
        said.append(outcome(plain_steps, model, opt, [data(step)], F.cross_entropy))
    return said


def test_the_check_for_pruning_before_each_step_walks_the_tree_only_after_a_change(monkeypatch: Any) -> None:
    """The check before each step compares each module's hook count, newest hook and class with those
    of the last check, and walks the tree's hooks only when one changed (before: every step, about
    1 us per module). Pruning after clean steps is still refused; the user's own hook is not."""
    from dtlab.models.compose import _habits

    walks: list[int] = []
    walk = _habits._renamers

    def counted(module: nn.Module) -> list[object]:
        walks.append(1)
        return walk(module)

    monkeypatch.setattr(_habits, "_renamers", counted)
    for said in run_world(2, pruned_after_steps, timeout=60):
        assert said[:4] == ["ran"] * 4 and "no longer has ['fc2.weight']" in said[4], said
    assert len(walks) == 2 * 3, len(walks)  # per rank: at wrapping, after the user's hook, after prune


class Embedded(nn.Module):
    """A vocabulary-parallel embedding with a padding row, then a column/row-parallel block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2 = (
            nn.Embedding(8, 16, padding_idx=5),
            nn.Linear(16, 32),
            nn.Linear(32, 16),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.emb(ids))))


def hf_init(gen: torch.Generator, m: nn.Module) -> None:
    """Hugging Face's _init_weights, from a private generator: normal weights, zero biases, the padding
    row zero (xavier for the block's first layer: its bound from the whole layer's fans)."""
    if isinstance(m, nn.Linear):
        (nn.init.xavier_uniform_ if m.out_features == 32 else nn.init.normal_)(m.weight, generator=gen)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02, generator=gen)
        if m.padding_idx is not None:
            m.weight.data[m.padding_idx].zero_()


def initialized_after_wrapping(backend: CommunicationBackend, dp: str) -> dict[str, torch.Tensor]:
    """``model.apply(init)`` after wrapping: tp=2, or dp2 x tp2 with ZeRO-3/FSDP over dp."""
    from dtlab.models import HybridShardedModel

    plan = {"emb": "vocab", "fc1": "colwise", "fc2": "rowwise"}
    mesh = Mesh(backend, {"dp": backend.world_size // 2, "tp": 2})
    if dp:
        model: Any = HybridShardedModel(Embedded(), mesh, data_parallel=dp, tensor_plan=plan)
    else:
        model = TensorParallelModel(Embedded(), mesh, plan=plan)
    model.apply(partial(hf_init, torch.Generator().manual_seed(4)))
    return model.full_state_dict()


def test_apply_after_wrapping_initializes_whole_layers() -> None:
    """model.apply(init) after wrapping ran init on each rank's slice: xavier's bound from the slice's
    fans, every tp rank drawing the same values from its generator (duplicated rows across the tp
    ranks), the padding row not zeroed where its index was local (1.4-1.6 relative error against
    one process). Split layers are now whole for init: one process's values exactly."""
    want = Embedded()
    want.apply(partial(hf_init, torch.Generator().manual_seed(4)))
    for world, dp in ((2, ""), (4, "fsdp")):
        for got in run_world(world, initialized_after_wrapping, dp, timeout=60):
            for k, v in want.state_dict().items():
                assert torch.equal(got[k], v), (dp, k)
