"""Optimizer-state habits under the data-parallel strategies on in-memory ranks: torch's global step
hooks see each step once (the strategy's local optimizer fired them too, twice per step);
``if rank == 0: torch.save(opt.state_dict())`` under ZeRO-1/2 (whole parameters, so
``model.state_dict()`` is local) ends in an error naming the fix instead of the backend's bare
collective timeout; ``ReduceLROnPlateau`` stepped with each rank's own loss (each rank stepping its
shard with its own learning rate, silently) is named by ``opt.state_dict()`` under ZeRO/FSDP; under tp
and pp another rank's part of the optimizer state is refused."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from test_strategies_helpers import make_data, make_module, wrap
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def global_hook_case(backend: CommunicationBackend, name: str) -> list[str]:
    """torch's global step hook (one rank: the hook dict is process-wide) sees each step once."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: list[str] = []
    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append(type(o).__name__))
    try:
        model = wrap(name, make_module(), backend)
        opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01)
        xs, ys = make_data(STEPS, GLOBAL_BATCH)
        F.mse_loss(model(xs[0]), ys[0]).backward()
        opt.step()
    finally:
        handle.remove()
    return seen


def test_torch_global_step_hooks_see_each_step_once() -> None:
    """The local optimizer over this rank's pieces steps without them (it fired them too: twice per step,
    and the element-wise check's probe steps at construction)."""
    for name in ("ddp", "zero1"):
        (seen,) = run_world(1, global_hook_case, name, timeout=30)
        assert seen == [{"ddp": "DDPOptimizer", "zero1": "ZeRO1Optimizer"}[name]], seen


def _save_on_rank_0(backend: CommunicationBackend, name: str) -> str:
    """``if rank == 0: torch.save(opt.state_dict(), path)`` (a DDP habit) while rank 1 goes on."""
    backend.check_collectives = False  # a user's default
    model = wrap(name, make_module(), backend)
    opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01)
    xs, ys = make_data(1, GLOBAL_BATCH)
    F.mse_loss(model(xs[0]), ys[0]).backward()
    opt.step()
    if backend.rank != 0:
        return "left"
    try:
        opt.state_dict()
    except StrategyError as exc:
        return str(exc)
    return "saved"


def test_optimizer_state_dict_on_one_rank_names_the_fix() -> None:
    """Under ZeRO-1/2 (whole parameters: model.state_dict() is local) opt.state_dict() is collective; on
    rank 0 alone it ended in the backend's bare collective timeout (300 s on Gloo): now that error names
    the fix. DDP's is local: it saves."""
    for name in ("ddp", "zero1", "zero2"):
        said = run_world(2, _save_on_rank_0, name, timeout=30)[0]
        if name == "ddp":
            assert said == "saved"
        else:
            assert "every rank must call it" in said and "if rank == 0: torch.save(sd, path)" in said, said


def _plateau(backend: CommunicationBackend, name: str) -> str:
    """ReduceLROnPlateau stepped with each rank's own loss: the ranks' learning rates part."""
    model = wrap(name, make_module(), backend)
    opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        F.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
        opt.zero_grad()
        sched.step(10.0 + s if backend.rank == 0 else 10.0 - s)  # rank 0's metric worsens, rank 1's not
    try:
        opt.state_dict()
    except StrategyError as exc:
        return str(exc)
    return "saved"


def test_options_that_differ_between_ranks_are_named_when_gathered() -> None:
    """Under ZeRO/FSDP each rank stepped its shard with its own learning rate, silently; opt.state_dict()
    gathers from every rank anyway and now names the difference (DDP's is local: not checked)."""
    for name in ("zero2", "fsdp"):
        for said in run_world(2, _plateau, name, timeout=30):
            assert "param group 0's 'lr' is 0.001" in said and "but 0.1 on rank 1" in said, said


class _Scaled(torch.nn.Module):
    """The tests' module times a 0-dim parameter (a logit scale, as CLIP's), plus one of 0 elements (an
    optional table sized 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_module()
        self.scale = torch.nn.Parameter(torch.tensor(1.3))
        self.none = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.none.sum()


def _scaled_steps(backend: CommunicationBackend | None, name: str, state: Any, first: int) -> Any:
    """Two AdamW steps from step ``first``: one process (``backend`` None) or ``name`` on in-memory
    ranks; ``state``: (module state, optimizer state: a torch state dict or dtlab's shards) to resume
    from. Returns the module state, torch's optimizer state dict and dtlab's shard."""
    module = _Scaled()
    if state is not None:
        module.load_state_dict(state[0])
    xs, ys = make_data(first + 2, GLOBAL_BATCH)
    if backend is None:
        model, opt, part = module, torch.optim.AdamW(module.parameters(), lr=0.01), slice(None)
    else:
        model = wrap(name, module, backend)
        opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01)
        half = GLOBAL_BATCH // backend.world_size
        part = slice(backend.rank * half, (backend.rank + 1) * half)
    if state is not None and isinstance(state[1], dict):
        opt.load_state_dict(state[1])
    elif state is not None:
        opt.load_sharded_state_dict(state[1])
    for s in range(first, first + 2):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()
    whole = model.state_dict() if backend is None else model.full_state_dict()
    shard = None if backend is None else opt.sharded_state_dict()
    return {k: v.detach().clone() for k, v in whole.items()}, opt.state_dict(), shard


def test_zero_dim_and_empty_parameter_state_resumes_under_zero() -> None:
    """A 0-dim parameter's Adam state loaded under ZeRO/FSDP (a torch state dict, or dtlab's shards saved
    under DDP, where it is a 0-dim tensor as in torch) stopped the next step with torch's raw 'output
    with shape [] doesn't match the broadcast shape [1]': the local optimizer stepped it as a
    1-element piece. Now it steps it 0-dim, as torch, and the resumed run equals one process. ZeRO-1/2's
    opt.state_dict() gave a parameter of 0 elements a state without 'step', so a plain torch optimizer
    loading it stopped at its step with KeyError 'step': now no state, as ZeRO-3's."""
    want = _scaled_steps(None, "", _scaled_steps(None, "", None, 0)[:2], 2)[0]
    for saver, loader, torch_format in (("zero2", "zero2", True), ("ddp", "zero3", False)):
        saved = run_world(2, _scaled_steps, saver, None, 0, timeout=30)
        state = saved[0][1] if torch_format else [r[2] for r in saved]
        got = run_world(2, _scaled_steps, loader, (saved[0][0], state), 2, timeout=30)[0][0]
        plain = _scaled_steps(None, "", (saved[0][0], saved[0][1]), 2)[0]  # a plain script loads it
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (saver, loader, k)
            assert torch.allclose(plain[k], v, rtol=1e-5, atol=1e-6), (saver, k)


def _handed_twice(backend: CommunicationBackend | None, name: str, fix: bool) -> Any:
    """Two AdamW steps, the module wrapped again and the same torch optimizer handed to a new strategy
    (``fix``: a new torch optimizer loading the first strategy's state instead), two more steps; one
    process (``backend`` None) steps its one optimizer throughout. The module state or the refusal."""
    module = make_module()
    inst = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    cls = OPT.get(name, ZeRO3Optimizer)
    model: Any = module if backend is None else wrap(name, module, backend)
    opt: Any = inst if backend is None else cls(model, inst)
    xs, ys = make_data(4, GLOBAL_BATCH)
    half = GLOBAL_BATCH // (1 if backend is None else backend.world_size)
    part = slice(0, None) if backend is None else slice(backend.rank * half, (backend.rank + 1) * half)
    for s in range(4):
        if s == 2 and backend is not None:
            saved = opt.state_dict()
            model = wrap(name, module, backend)
            try:
                if fix:
                    opt = cls(model, torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1))
                    opt.load_state_dict(saved)
                else:
                    opt = cls(model, inst)
            except StrategyError as exc:
                return str(exc)
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()
    whole = model.full_state_dict() if backend is not None else module.state_dict()
    return {k: v.detach().clone() for k, v in whole.items()}


def test_torch_optimizer_handed_to_a_second_strategy_is_refused() -> None:
    """The strategy a torch optimizer is handed to holds its state (and the hooks registered on it since):
    handed again to a strategy over the module wrapped anew, the instance gave none (Adam's moments
    restarted silently: 0.17 relative error after 2 + 2 steps under DDP, ZeRO-1/2) or, when it came with
    state, that stale state through a refusal about state_dict(). Now refused naming the fix, which equals
    one process."""
    want = _handed_twice(None, "", False)
    for name in ("ddp", "zero2"):
        said = run_world(2, _handed_twice, name, False, timeout=30)[0]
        assert isinstance(said, str) and f"was handed to {OPT[name].__name__} already" in said, said
        assert "opt.load_state_dict(first_opt.state_dict())" in said, said
        got = run_world(2, _handed_twice, name, True, timeout=30)[0]
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (name, k)


class _Lion(torch.optim.SGD):
    """A user's optimizer class (not in torch.optim)."""


def _handed_own_class(backend: CommunicationBackend) -> str:
    module = make_module()
    inst = _Lion(module.parameters(), lr=0.01)
    DDPOptimizer(wrap("ddp", module, backend), inst)
    try:
        DDPOptimizer(wrap("ddp", module, backend), inst)
    except StrategyError as exc:
        return str(exc)
    return ""


def test_a_users_optimizer_class_handed_twice_is_named_as_it_is() -> None:
    """The fix names the user's class, not a torch.optim class of that name (torch.optim._Lion)."""
    said = run_world(1, _handed_own_class, timeout=30)[0]
    assert "opt = DDPOptimizer(model, _Lion(model.parameters(), ...))" in said, said


def _rank_0_state(backend: CommunicationBackend, pp: bool, layers: int = 2) -> dict[str, Any]:
    """``if rank == 0: torch.save(opt.state_dict())``, then every rank loads that file, under tp=2 or
    pp=2 (``layers`` layers: 2, two stages of equal shapes; 3, stages of 2 and 1); and each rank's own
    state (what resumes)."""
    from filled import filled
    from test_tensor_habits import PLAN, build, data
    from torch import nn

    from dtlab.backends import Mesh
    from dtlab.models import PipelineParallelModel, TensorParallelModel

    mesh = Mesh(backend, {"pp" if pp else "tp": 2})
    if pp:
        net = filled(
            nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(8, 8), nn.Tanh())]), 0, scale=0.4
        )
        model: Any = PipelineParallelModel(net, mesh, micro_batches=2)
    else:
        model = TensorParallelModel(build(), mesh, plan=PLAN)
    opt = ZeRO1Optimizer(model, torch.optim.AdamW, lr=0.01)
    x, y = data(0)
    if pp:
        model.train_step((x, y), lambda o, t: F.cross_entropy(o[:, :4], t))
    else:
        F.cross_entropy(model(x), y).backward()
    opt.step()
    own = opt.state_dict()
    out: dict[str, Any] = {}
    for case, sd in (("own", own), ("rank_0", backend.broadcast_object(own, src=0))):
        try:
            opt.load_state_dict(sd)
            out[case] = "loaded"
        except StrategyError as exc:
            out[case] = str(exc)
    return out


def test_another_rank_s_optimizer_state_is_refused_under_tp_and_pp() -> None:
    """Under tensor and pipeline parallelism opt.state_dict() is this rank's part (its slices, its
    stages). Rank 0's, loaded by every rank (a DDP resume habit), loaded silently where the shapes
    match (3.1e-2 relative error after 3 more AdamW steps at tp=2, 4.8e-2 at pp=2): now every rank
    refuses, naming the parameter and the fix. Each rank's own still loads. With stages of different
    sizes rank 1 refused rank 0's state by its per-group size before the part check, a consensus, in
    which rank 0 waited (the backend's timeout; in memory 'can never complete'): the part is checked
    first now, so every rank refuses naming the fix."""
    for pp, layers in ((False, 2), (True, 2), (True, 3)):
        for rank, res in enumerate(run_world(2, _rank_0_state, pp, layers, timeout=60)):
            assert res["own"] == "loaded", res["own"]
            said = res["rank_0"]
            assert "opt.state_dict() is this rank's part" in said and "f'opt_{rank}.pt'" in said, said
            if rank == 1:
                assert "piece" in said and "here" in said, said


class _Branch(torch.nn.Module):
    """A trunk, and a head the loss uses only from step 2 on."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
        filled(self, 0, scale=0.4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.trunk(x) + (self.head(x) if step >= 2 else 0)


def _branch_steps(backend: CommunicationBackend | None, name: str, state: Any) -> Any:
    """Steps 0-1 under ``name`` with find_unused_parameters (module and torch-format optimizer state
    returned), or, with ``state``, one process resuming from it at steps 2-3 (from scratch: None)."""
    module = _Branch()
    xs, ys = make_data(4, GLOBAL_BATCH)
    if backend is not None:
        model = wrap(name, module, backend, find_unused_parameters=True)
        opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        half = GLOBAL_BATCH // backend.world_size
        part = slice(backend.rank * half, (backend.rank + 1) * half)
        for s in range(2):
            F.mse_loss(model(xs[s][part], s), ys[s][part]).backward()
            opt.step()
            opt.zero_grad()
        return model.full_state_dict(), opt.state_dict()
    plain = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    if state is not None:
        module.load_state_dict(state[0])
        plain.load_state_dict(state[1])
    for s in range(0 if state is None else 2, 4):
        F.mse_loss(module(xs[s], s), ys[s]).backward()
        plain.step()
        plain.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_state_dict_of_parameters_not_stepped_yet_loads_in_torch() -> None:
    """ZeRO-1/2's opt.state_dict() gave a parameter with no optimizer state yet (unused so far, under
    find_unused_parameters) its unit's element-wise keys as zeros without 'step', so a torch optimizer
    loading it (a plain script, or the strategy itself) stopped at that parameter's first step with
    KeyError 'step'. Now it has no state, as in torch, and the resumed run equals one process."""
    want = _branch_steps(None, "", None)
    for name in ("zero1", "zero2"):
        saved = run_world(2, _branch_steps, name, None, timeout=30)[0]
        assert sorted(saved[1]["state"]) == [0, 1], (name, sorted(saved[1]["state"]))
        got = _branch_steps(None, "", saved)
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (name, k)


class Lookahead(torch.optim.Optimizer):
    """A user's Lookahead around another torch optimizer: every ``k`` steps the weights move ``alpha``
    of the way from the slow weights to the fast ones and restart from there (element-wise)."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        super().__init__(base.param_groups, base.defaults)
        self.base, self.k, self.alpha, self.n = base, k, alpha, 0
        self.param_groups = base.param_groups
        self.slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]

    def step(self, closure: Any = None) -> Any:
        loss = self.base.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            with torch.no_grad():
                for s, p in zip(self.slow, [p for g in self.param_groups for p in g["params"]], strict=True):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)
        return loss


def _lookahead(backend: CommunicationBackend | None, name: str) -> Any:
    """4 SGD steps under Lookahead: handed to the strategy (refused), then around the strategy."""
    module = make_module()
    xs, ys = make_data(4, GLOBAL_BATCH)
    part = slice(None) if backend is None else slice(backend.rank * 4, backend.rank * 4 + 4)
    if backend is None:
        model: Any = module
        opt: Any = Lookahead(torch.optim.SGD(module.parameters(), lr=0.1))
        said = ""
    else:
        model = wrap(name, module, backend)
        try:
            OPT[name](model, Lookahead(torch.optim.SGD(module.parameters(), lr=0.1)))
            said = "built"
        except StrategyError as exc:
            said = str(exc)
        model = wrap(name, module, backend)
        opt = Lookahead(OPT[name](model, torch.optim.SGD(module.parameters(), lr=0.1)))
    for s in range(4):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()
    state = module.state_dict() if backend is None else model.full_state_dict()
    return said, {k: v.detach().clone() for k, v in state.items()}


def test_an_optimizer_wrapping_another_is_named_and_wraps_the_strategy() -> None:
    """A Lookahead handed to the strategy stopped with the raw AttributeError its constructor raised when
    rebuilt over this rank's pieces ('list' object has no attribute 'param_groups'): refused now, naming
    the fix (Lookahead around the strategy), which equals one process under DDP and ZeRO-2."""
    want = _lookahead(None, "")[1]
    for name in ("ddp", "zero2"):
        for said, got in run_world(2, _lookahead, name, timeout=30):
            assert "rebuilds Lookahead over this rank's pieces" in said and "wrap the strategy" in said, said
            for k, v in want.items():
                assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (name, k)
