"""``opt.clip_grad_value_(v)`` on a mesh (tensor, pipeline and hybrid parallelism, 4 in-memory ranks),
against torch's ``clip_grad_value_`` over one process's parameters on the global batch (3 SGD-momentum
steps of the built-in transformer).

It clamped the gradients the global norm counts on this rank, which hold each tensor once over the
mesh: a parameter left whole only on tp rank 0, every gradient under DDP only on dp rank 0, a weight
tied across pipeline stages on one stage only. The other copies were stepped unclipped and drifted
apart, with no error (the worst rank's copy of the model): 0.41 relative error after 3 steps at
dp2 x tp2 under DDP, 0.40 under ZeRO-2, 0.41 at dp2 x pp2 under DDP, 0.35 at pp2 x tp2 with the
embedding tied to the head across stages. It now clamps every gradient the rank steps (whole or its
shard), as torch clamps every parameter's.

``opt.clip_grad_norm_`` returned the global norm as float32 for a float64 model (torch returns it in
the gradients' dtype): 2.5e-8 relative from one process's; it is float64 there now.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hybrid_cases import OPTIMIZER_OF
from test_tensor_helpers import CFG, batch, initial_state

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel, transformer_plan
from dtlab.testing import run_world
from dtlab.trainers.models import TransformerLM

STEPS, CLIP = 3, 1e-3


def build(tie: bool) -> TransformerLM:
    net = TransformerLM(**CFG, tie_embeddings=tie)  # type: ignore[arg-type]
    state = initial_state()
    if tie:
        state["head.weight"] = state["tok.weight"]
    net.load_state_dict(state)
    return net


def one_process(tie: bool) -> dict[str, torch.Tensor]:
    net = build(tie)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    x, y = batch()
    for _ in range(STEPS):
        F.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def clipped(backend: CommunicationBackend, shape: dict[str, int], kind: str, tie: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = Mesh(backend, shape)
    pipe: dict[str, Any] = {"micro_batches": 2} if mesh.size("pp") > 1 else {}
    plan = transformer_plan() if mesh.size("tp") > 1 else None
    model = HybridShardedModel(build(tie), mesh, data_parallel=kind, tensor_plan=plan, **pipe)
    opt = OPTIMIZER_OF[kind](model, torch.optim.SGD, lr=0.5, momentum=0.9)
    x, y = (t.chunk(mesh.size("dp"))[mesh.coordinate("dp")] for t in batch())
    for _ in range(STEPS):
        model.train_step((x, y), model.cross_entropy)
        opt.clip_grad_value_(CLIP)
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def test_clip_grad_value_on_a_mesh_equals_one_process() -> None:
    cases = [
        ({"dp": 2, "tp": 2}, "ddp", False),
        ({"dp": 2, "tp": 2}, "zero2", False),
        ({"dp": 2, "pp": 2}, "ddp", False),
        ({"pp": 2, "tp": 2}, "ddp", True),  # the embedding tied to the head across stages
    ]
    want = {tie: one_process(tie) for tie in (False, True)}
    for shape, kind, tie in cases:
        for rank, got in enumerate(run_world(4, clipped, shape, kind, tie, timeout=120)):
            ref = want[tie]
            err = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            scale = max(float(ref[k].abs().max()) for k in ref)
            assert err <= 1e-5 * scale, f"{shape} {kind} tie={tie} rank {rank}: {err / scale:.2e} rel error"


def norms(backend: CommunicationBackend) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    model = HybridShardedModel(
        build(False).double(), Mesh(backend, {"tp": 2}), "ddp", tensor_plan=transformer_plan()
    )
    opt = OPTIMIZER_OF["ddp"](model, torch.optim.SGD, lr=0.5)
    model.train_step(batch(), model.cross_entropy)
    return [opt.clip_grad_norm_(1e9, norm_type=t) for t in (2.0, 1.0, float("inf"))]


def test_the_global_norm_of_a_float64_model_is_float64_as_torch_s() -> None:
    """It was rounded to float32: 2.5e-8 from one process's (2-norm, float64 at tp=2); now 2e-16."""
    net = build(False).double()
    x, y = batch()
    F.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1)).backward()
    want = [
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9, norm_type=t) for t in (2.0, 1.0, float("inf"))
    ]
    for rank, got in enumerate(run_world(2, norms, timeout=60)):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float64, f"rank {rank}: {g.dtype}"
            assert abs(float(g) - float(w)) <= 1e-12 * float(w), f"rank {rank}: {float(g)!r} != {float(w)!r}"
