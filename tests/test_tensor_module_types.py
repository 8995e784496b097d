"""Code that walks modules by type under tensor parallelism (tp=2 and dp2 x tp2, in-memory ranks): the
split layers are ``nn.Linear`` / ``nn.Embedding`` (whole sizes, this rank's weights), so
``model.apply(init)`` with an ``isinstance(m, nn.Linear)`` constant init equals one process exactly and
nanoGPT's ``configure_optimizers`` (weight decay by layer type) puts every parameter in its group and
trains (AdamW, float64) as one process does. Before, the split layers were neither: the constant init
left them untouched (max abs error 1.44 against one process here) and nanoGPT's assert raised.

A seeded random init draws each rank's piece on its own (the tp ranks' pieces come out equal, not one
process's values); ``reset_parameters()`` draws with the whole layer's fan-in. Hugging Face's
``_init_weights`` reaches every split layer and zeroes the padding row where a rank holds it; its
``resize_token_embeddings`` on the wrapped module is refused at the next forward."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.models.tensor import ColwiseParallel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.testing import run_world

V, D, H, PAD = 16, 8, 32, 11  # PAD: row 3 of tp rank 1's half of the vocabulary
PLAN = {"tok": "vocab", "fc1": "colwise", "fc2": "rowwise", "head": ColwiseParallel(gather_output=True)}
STEPS, LR, WD = 3, 0.01, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D, padding_idx=PAD)
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        return self.head(h + self.fc2(F.gelu(self.fc1(self.ln(h)))))


def build() -> Net:
    net = Net().double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return net


def constant_init(m: nn.Module) -> None:
    """A typical init by layer type (Hugging Face's shape: the padding row indexed in ``weight``)."""
    with torch.no_grad():
        if isinstance(m, nn.Linear):
            m.weight.fill_(0.02)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.fill_(0.5)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()


def seeded_normal(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02, generator=torch.Generator().manual_seed(1))


def configure_optimizers(model: nn.Module) -> tuple[torch.optim.AdamW, list[str], list[str]]:
    """nanoGPT's ``configure_optimizers``: decay the weights of ``nn.Linear``, not biases nor the weights
    of ``nn.LayerNorm`` / ``nn.Embedding``; every parameter in exactly one group."""
    decay, no_decay = set(), set()
    whitelist, blacklist = (nn.Linear,), (nn.LayerNorm, nn.Embedding)
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters():
            fpn = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias"):
                no_decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, whitelist):
                decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, blacklist):
                no_decay.add(fpn)
    params = dict(model.named_parameters())
    assert not decay & no_decay, f"parameters {decay & no_decay} made it into both sets"
    assert not params.keys() - (decay | no_decay), f"{params.keys() - (decay | no_decay)} were not separated"
    groups = [
        {"params": [params[n] for n in sorted(decay)], "weight_decay": WD},
        {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95)), sorted(decay), sorted(no_decay)


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (4, 6), generator=gen), torch.randint(0, V, (4, 6), generator=gen)


def train(model: nn.Module, opt: Any, dp: int = 1, c: int = 0) -> None:
    for s in range(STEPS):
        x, y = (t.chunk(dp)[c] for t in data(s))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


def reference() -> dict[str, Any]:
    net = build()
    out: dict[str, Any] = {"modules": _modules(net)}
    out["constant"] = build().apply(constant_init).state_dict()
    out["seeded"] = build().apply(seeded_normal).state_dict()
    opt, out["decay"], out["no_decay"] = configure_optimizers(net)
    train(net, opt)
    out["trained"] = net.state_dict()
    return out


def _modules(root: nn.Module) -> list[tuple[str, str, int, int]]:
    """Each nn.Linear / nn.Embedding by name, with its sizes (what LoRA-style discovery reads)."""
    found = []
    for n, m in root.named_modules():
        if isinstance(m, nn.Linear):
            found.append((n, "Linear", m.in_features, m.out_features))
        elif isinstance(m, nn.Embedding):
            found.append((n, "Embedding", m.num_embeddings, m.embedding_dim))
    return found


def world(backend: CommunicationBackend, shape: dict[str, int]) -> dict[str, Any]:
    mesh = Mesh(backend, shape)
    dp, c = mesh.size("dp"), mesh.coordinate("dp")
    model = TensorParallelModel(build(), mesh, plan=PLAN)
    out: dict[str, Any] = {"modules": _modules(model.module)}
    model.module.apply(constant_init)
    out["constant"] = model.full_state_dict()
    model = TensorParallelModel(build(), mesh, plan=PLAN)
    model.module.apply(seeded_normal)
    out["seeded"] = model.module.fc1.weight.detach().clone()
    model.module.fc2.reset_parameters()  # row-parallel: 16 of the 32 input features here
    out["reset_max"] = float(model.module.fc2.weight.detach().abs().max())
    for name, strategy in (("ddp", DDPOptimizer), ("zero1", ZeRO1Optimizer)):
        model = TensorParallelModel(build(), mesh, plan=PLAN)
        opt, out["decay"], out["no_decay"] = configure_optimizers(model.module)
        train(model, strategy(model, opt), dp, c)
        out[name] = model.full_state_dict()
    return out


def _max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_split_layers_keep_their_types_for_init_and_param_groups() -> None:
    torch.set_num_threads(1)
    ref = reference()
    bound = 1 / math.sqrt(H)  # nn.Linear's, from the whole fan-in
    for shape in ({"tp": 2}, {"dp": 2, "tp": 2}):
        for rank, out in enumerate(run_world(2 * shape.get("dp", 1), world, shape, timeout=120)):
            where = f"{shape} rank {rank}"
            assert out["modules"] == ref["modules"], where
            assert _max_error(out["constant"], ref["constant"]) == 0.0, where
            piece, whole = out["seeded"], ref["seeded"]["fc1.weight"]  # rank 0's piece: whole's first half
            assert torch.equal(piece, whole[: H // 2]), f"{where}: each rank draws its piece from the seed"
            assert bound / 2 < out["reset_max"] <= bound, f"{where}: {out['reset_max']} vs bound {bound}"
            assert (out["decay"], out["no_decay"]) == (ref["decay"], ref["no_decay"]), where
            for name in ("ddp", "zero1"):
                err = _max_error(out[name], ref["trained"])
                assert err <= 1e-10, f"{where} {name}: max abs error {err:.2e} after {STEPS} AdamW steps"


def hf_world(backend: CommunicationBackend) -> dict[str, Any]:
    from hf_cases import LLAMA_PLAN, llama, token_batch

    net = llama(layers=1, pad_token_id=20)  # id 20: row 4 of tp rank 1's half of the 32 ids
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    model = TensorParallelModel(net, backend, plan=LLAMA_PLAN)
    inner = model.module
    inner.apply(inner._init_weights)  # Hugging Face's init, as its post_init calls it
    linears = [m.weight for m in inner.modules() if isinstance(m, nn.Linear)]
    emb = inner.get_input_embeddings()
    pad = emb.padding_idx
    out: dict[str, Any] = {
        "linear_max": max(float(w.detach().abs().max()) for w in linears),
        "padding_idx": pad,
        "padding_row": None if pad is None else float(emb.weight[pad].detach().abs().max()),
    }
    inner.resize_token_embeddings(40)
    try:
        model(token_batch(2, seed=0)[0])
        out["resized"] = "ran"
    except StrategyError as exc:
        out["resized"] = str(exc)
    return out


def test_hugging_face_init_and_resize_on_split_layers() -> None:
    from hf_cases import transformers_module

    transformers_module()
    torch.set_num_threads(1)
    for rank, out in enumerate(run_world(2, hf_world, timeout=120)):
        assert out["linear_max"] < 0.2, f"rank {rank}: a split layer kept its 1.0 ({out['linear_max']})"
        assert out["padding_idx"] == (4 if rank else None), f"rank {rank}: {out['padding_idx']}"
        assert out["padding_row"] == (0.0 if rank else None), f"rank {rank}: {out['padding_row']}"
        assert "resize the plain model before wrapping" in out["resized"], f"rank {rank}: {out['resized']}"


def test_a_split_layer_is_not_split_again() -> None:
    def again(backend: CommunicationBackend) -> str:
        model = TensorParallelModel(build(), backend, plan=PLAN)
        try:
            TensorParallelModel(model.module, backend, plan=PLAN)
        except StrategyError as exc:
            return str(exc)
        return "split twice"

    for rank, msg in enumerate(run_world(2, again, timeout=60)):
        assert "already split over tp" in msg, f"rank {rank}: {msg}"
