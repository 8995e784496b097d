"""Activation checkpointing with dropout on in-memory ranks (threads sharing torch's global RNG): the
recomputation in backward draws the masks its forward drew, so the gradients are those autograd gives
without checkpointing for the very masks of the forward (captured at the dispatcher and replayed in a
run without checkpointing). Under DDP with checkpointed blocks, and per pipeline stage (alone, and
around checkpointed blocks: nested regions)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from hf_cases import transformers_module
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.errors import StrategyError
from dtlab.models import DDPModel, PipelineParallelModel
from dtlab.models.checkpointing import ReplayedDraws, checkpoint_modules
from dtlab.testing import run_world

STEPS = 6
BERNOULLI = torch.ops.aten.bernoulli_.float  # what dropout (and attention's, on the CPU) draws with


class Draws(TorchDispatchMode):
    """This thread's dropout draws: recorded (those of forwards, those of recomputations in a
    backward), or, given ``replay``, each replaced by the next of those values."""

    def __init__(self, replay: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.forward: list[torch.Tensor] = []
        self.recomputed: list[torch.Tensor] = []
        self.replay = replay

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not BERNOULLI or args[0].is_meta:  # a pipeline's shape probe draws nothing
            return func(*args, **(kwargs or {}))
        if self.replay is not None:
            return args[0].copy_(self.replay.pop(0))
        out = func(*args, **(kwargs or {}))
        in_backward = torch._C._current_graph_task_id() != -1  # -1: outside any backward
        (self.recomputed if in_backward else self.forward).append(out.clone())
        return out


class _Block(nn.Sequential):
    pass


def _net() -> nn.Sequential:
    def block() -> _Block:
        return _Block(nn.Linear(32, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.3))

    return filled(nn.Sequential(nn.Linear(16, 32), block(), block(), nn.Linear(32, 4)), 0, scale=0.3)


def _steps(backend: CommunicationBackend, how: str, replay: list[torch.Tensor] | None) -> dict[str, Any]:
    """``STEPS`` gradients of ``how`` (``ddp``: each rank its own batches; ``pp``: a 1f1b pipeline over
    4 micro-batches, its stages checkpointed; ``pp+blocks``: the blocks inside them too), checkpointed
    and recording its draws, or (``replay``) without checkpointing, replaying the given draws."""
    torch.set_num_threads(1)
    net, ckpt = _net(), replay is None
    if ckpt and how != "pp":
        checkpoint_modules(net, (_Block,))
    pipelined = how.startswith("pp")
    model: Any = (
        PipelineParallelModel(net, backend, "1f1b", micro_batches=4, activation_checkpointing=ckpt)
        if pipelined
        else DDPModel(net, backend)
    )
    g = torch.Generator().manual_seed(0 if pipelined else 1 + backend.rank)  # one batch per pipeline
    grads = []
    with Draws(replay) as draws:
        for _ in range(STEPS):
            x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
            if pipelined:
                model.train_step((x, y), F.mse_loss)
            else:
                F.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
            for p in net.parameters():
                p.grad = None
    return {"grads": grads, "forward": draws.forward, "recomputed": draws.recomputed}


@pytest.mark.parametrize(("how", "ranks"), [("ddp", 4), ("pp", 2), ("pp+blocks", 2)])
def test_a_recomputation_draws_the_masks_of_its_forward_on_in_memory_ranks(how: str, ranks: int) -> None:
    """Each rank's recomputations drew other masks than its forwards (another rank's draws in between:
    e.g. 90 of 128 under DDP on 4 ranks, gradients 1.6 off relative to the forward's): now each draws
    from a generator of its region's own, seeded again for the recomputation."""
    ckpt = run_world(ranks, _steps, how, None, timeout=120)
    replays = [list(r["forward"]) for r in ckpt]
    plain = run_world(ranks, lambda b: _steps(b, how, replays[b.rank]), timeout=120)
    for rank, (got, want) in enumerate(zip(ckpt, plain, strict=True)):
        forward, recomputed = got["forward"], got["recomputed"]
        assert len(recomputed) >= len(forward) > 0, (rank, len(recomputed), len(forward))  # nested: twice
        other = sum(not any(torch.equal(r, f) for f in forward) for r in recomputed)
        assert other == 0, f"rank {rank}: {other} of {len(recomputed)} recomputed masks are no forward's"
        for step, (a, b) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            for i, (p, q) in enumerate(zip(a, b, strict=True)):
                torch.testing.assert_close(
                    p, q, rtol=1e-6, atol=1e-7, msg=f"rank {rank} step {step} grad {i}"
                )


class _Masked(nn.Dropout):
    """Dropout recording the masks of its forwards and of its recomputations (its zeros: the input has
    none), or, given ``replay``, applying those of a forward in turn."""

    def __init__(self, replay: list[torch.Tensor] | None) -> None:
        super().__init__(0.3)
        self.forwards: list[torch.Tensor] = []
        self.recomputed: list[torch.Tensor] = []
        self.replay = replay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replay is not None:
            return x * self.replay.pop(0) / 0.7
        out = super().forward(x)
        in_backward = torch._C._current_graph_task_id() != -1  # -1: outside any backward
        (self.recomputed if in_backward else self.forwards).append(out != 0)
        return out


def _compiled(backend: CommunicationBackend, replay: list[list[torch.Tensor]] | None) -> dict[str, Any]:
    """DDP over ``torch.compile`` of a model whose checkpointed block (dropout, BatchNorm) runs eagerly;
    ``replay``: not compiled nor checkpointed, each dropout's forward masks applied."""
    torch.set_num_threads(1)
    drops = [_Masked(None if replay is None else replay[i]) for i in range(4)]
    # a Tanh last: the recomputation stops after the last tensor saved, which a dropout's mask would be
    first = _Block(nn.Linear(16, 32), nn.BatchNorm1d(32), drops[0], nn.Linear(32, 32), drops[1], nn.Tanh())
    second = _Block(nn.Linear(32, 32), drops[2], nn.Tanh(), nn.Linear(32, 32), drops[3], nn.Tanh())
    net = filled(nn.Sequential(first, second, nn.Linear(32, 4)), 0, scale=0.3)
    if replay is None:
        checkpoint_modules(net, (_Block,))
    model = DDPModel(torch.compile(net) if replay is None else net, backend)
    g = torch.Generator().manual_seed(backend.rank)
    grads = []
    for _ in range(STEPS):
        F.mse_loss(model(torch.randn(16, 16, generator=g)), torch.randn(16, 4, generator=g)).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        for p in net.parameters():
            p.grad = None
    return {
        "grads": grads,
        "forward": [d.forwards for d in drops],
        "recomputed": [d.recomputed for d in drops],
    }


def test_under_torch_compile_too() -> None:
    """The checkpointed block runs eagerly in the compiled model (one graph break): its recomputations
    drew other masks than its forwards on in-memory ranks, as in eager mode."""
    # the count is process-wide, and code an earlier test compiled in this process (the same modules'
    # forwards) would serve this model from dynamo's cache: counted from a fresh cache
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]["total"]
    ckpt = run_world(4, _compiled, None, timeout=300)
    assert torch._dynamo.utils.counters["frames"]["total"] > frames  # traced indeed
    replays = [[list(masks) for masks in r["forward"]] for r in ckpt]
    plain = run_world(4, lambda b: _compiled(b, replays[b.rank]), timeout=120)
    for rank, (got, want) in enumerate(zip(ckpt, plain, strict=True)):
        for forward, recomputed in zip(got["forward"], got["recomputed"], strict=True):
            assert len(recomputed) == len(forward) == STEPS
            assert all(any(torch.equal(r, f) for f in forward) for r in recomputed), rank
        for a, b in zip(got["grads"], want["grads"], strict=True):
            for p, q in zip(a, b, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def _native_dropout(backend: CommunicationBackend) -> str:
    class Native(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.native_dropout(super().forward(x), 0.3, self.training)[0]

    net = filled(nn.Sequential(Native(4, 4), nn.Linear(4, 1)), 0)
    assert checkpoint_modules(net, (Native,)) == 1
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(backend.rank))
    with pytest.raises(StrategyError) as caught:
        net(x).sum().backward()
    net.eval()
    net(x).sum().backward()  # drawing nothing: allowed
    return str(caught.value)


def test_a_random_op_taking_no_generator_is_refused_with_the_fix() -> None:
    for message in run_world(2, _native_dropout, timeout=60):
        assert "aten.native_dropout.default draws random numbers on the CPU" in message
        assert "torch.nn.functional.dropout), run the ranks as processes (gloo)" in message


def test_off_the_rank_threads_torch_handles_the_draws_alone() -> None:
    """A process of its own (or a one-rank world, run on the caller's thread): nothing replaces
    torch's own handling, so the numbers are those of a run without checkpointing."""
    forward, recompute = ReplayedDraws()()
    assert isinstance(forward, nullcontext) and isinstance(recompute, nullcontext)
    on_ranks = run_world(2, lambda _: [isinstance(c, nullcontext) for c in ReplayedDraws()()], timeout=60)
    assert on_ranks == [[False, False]] * 2


def _gpt2(backend: CommunicationBackend, replay: list[torch.Tensor] | None) -> dict[str, Any]:
    """A tiny GPT-2 with dropout 0.3 (embeddings, residuals, attention) under DDP, Hugging Face's own
    checkpointing on with ``context_fn=ReplayedDraws()`` (``replay``: off, the draws replayed)."""
    torch.set_num_threads(1)
    transformers = transformers_module()
    config = transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
    )  # fmt: skip
    with seeded_init(0):
        net = transformers.GPT2LMHeadModel(config)
    if replay is None:  # the name of recent transformers, else the older one
        kwargs = {"use_reentrant": False, "context_fn": ReplayedDraws()}
        if hasattr(net, "activation_checkpointing_enable"):
            net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    net.config.use_cache = False
    model = DDPModel(net.train(), backend)
    g = torch.Generator().manual_seed(backend.rank)
    grads = []
    with Draws(replay) as draws:
        for _ in range(3):
            x = torch.randint(0, 32, (4, 8), generator=g)
            model(x, labels=x).loss.backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            for p in net.parameters():
                p.grad = None
    return {"grads": grads, "forward": draws.forward, "recomputed": draws.recomputed}


def test_hugging_face_checkpointing_with_replayed_draws_gets_the_forward_masks() -> None:
    """Hugging Face's own checkpointing calls torch.utils.checkpoint: given ``context_fn=ReplayedDraws()``
    its recomputations draw the forward's masks (without it: 20 to 31 of 72 masks differed, gradients
    1.4 to 2.5 off)."""
    transformers_module()  # imported before the ranks start (its lazy import is not thread-safe)
    ckpt = run_world(2, _gpt2, None, timeout=120)
    replays = [list(r["forward"]) for r in ckpt]
    plain = run_world(2, lambda b: _gpt2(b, replays[b.rank]), timeout=120)
    for rank, (got, want) in enumerate(zip(ckpt, plain, strict=True)):
        assert len(got["recomputed"]) > 0  # the embeddings' dropout is not checkpointed
        assert all(any(torch.equal(r, f) for f in got["forward"]) for r in got["recomputed"]), rank
        for a, b in zip(got["grads"], want["grads"], strict=True):
            for p, q in zip(a, b, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"rank {rank}")
