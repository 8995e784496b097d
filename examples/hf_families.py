"""Hugging Face families under dtlab's strategies, each against one process on the same global batch.

    OMP_NUM_THREADS=1 python examples/hf_families.py           # every family, every strategy
    OMP_NUM_THREADS=1 python examples/hf_families.py Gemma Phi-3   # some families
    OMP_NUM_THREADS=1 python examples/hf_families.py --hybrid      # the meshes, on 4 and 8 ranks

Each family is a tiny model built from its config (no network, no weights: 2 layers, hidden 32, 4
heads, 64 tokens), float32, no dropout. Every strategy runs on 2 in-memory ranks: tensor parallel
(tp=2, ``plan="auto"``: the model's own plan; T5's by hand, ``HAND_PLANS``), ZeRO-3 and FSDP (one
unit per layer) over dp=2, each rank half the batch, and a pipeline of 2 stages split at the second
layer (2 micro-batches). After 2 SGD steps the printed figure is the largest relative error of a
parameter against one process (over the parameters whose norm exceeds 1e-2: a key projection's bias
has a zero gradient in exact arithmetic, so its value is round-off), or what refused the run.
"meta": the model built on the meta device and wrapped with ``init_seed`` under tp=2 (ZeRO-3 where
tp is refused): whether it holds bitwise the model ZeRO-3 builds from the same seed, its buffers
equal a plain build's, and its loss is the plain model's on that state. The table in
docs/your_model.md, "Hugging Face families", is this program's output. ``--hybrid``: each family
with a tensor plan under dp 2 x tp 2 (FSDP) and pp 2 x dp 2 x tp 2 (FSDP, ZeRO-1) against one
process, and built on meta under pp 2 x dp 2 x tp 2 against ZeRO-3's build from the same seed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers as hf
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import DtlabError
from dtlab.models import (
    FSDPModel,
    HybridShardedModel,
    ModuleClassPolicy,
    PipelineParallelModel,
    TensorParallelModel,
    ZeRO3Model,
)
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

VOCAB, SEQ, LR, STEPS = 64, 8, 0.5, 2
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": SEQ,
}  # fmt: skip
GQA = {**SIZES, "num_key_value_heads": 2, "use_cache": False}
SEQ2SEQ: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False}
#: name -> (build, its layer class name (an FSDP unit), the pipeline's split point, encoder-decoder)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], str, str, bool]] = {
    "Qwen2": (
        lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**GQA)), "Qwen2DecoderLayer", "model.layers.1", False
    ),
    "Mistral": (
        lambda: hf.MistralForCausalLM(hf.MistralConfig(**GQA, sliding_window=4)),
        "MistralDecoderLayer", "model.layers.1", False,
    ),
    "Phi-3": (
        lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**GQA, pad_token_id=0, eos_token_id=0, resid_pdrop=0.0)),
        "Phi3DecoderLayer", "model.layers.1", False,
    ),
    "GPT-NeoX": (
        lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**SIZES, rotary_pct=0.5, hidden_dropout=0.0)),
        "GPTNeoXLayer", "gpt_neox.layers.1", False,
    ),
    "Gemma": (
        lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**GQA, head_dim=8)), "GemmaDecoderLayer", "model.layers.1",
        False,
    ),
    "Qwen3": (
        lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**GQA, head_dim=8)),
        "Qwen3DecoderLayer", "model.layers.1", False,
    ),
    "Gemma3": (
        lambda: hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(**GQA, head_dim=8, sliding_window=4)),
        "Gemma3DecoderLayer", "model.layers.1", False,
    ),
    "BERT": (
        lambda: hf.BertForMaskedLM(
            hf.BertConfig(**SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        ),
        "BertLayer", "bert.encoder.layer.1", False,
    ),
    "T5": (
        lambda: hf.T5ForConditionalGeneration(hf.T5Config(
            **SEQ2SEQ, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0,
        )),
        "T5Block", "decoder", True,
    ),
    "BART": (
        lambda: hf.BartForConditionalGeneration(hf.BartConfig(
            **SEQ2SEQ, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        )),
        "BartEncoderLayer", "model.decoder", True,
    ),
}  # fmt: skip
STRATEGIES = ["tp2", "zero3", "fsdp", "pp2"]
#: tensor plans given by hand where the model declares none (T5: its feed-forward layers only; its
#: attention's heads cannot be split beside its per-head position bias, which dtlab refuses)
HAND_PLANS: dict[str, dict[str, str]] = {
    "T5": {
        f"{part}.block.*.layer.{i}.DenseReluDense.{name}": style
        for part, i in (("encoder", 1), ("decoder", 2))
        for name, style in (("wi", "colwise"), ("wo", "rowwise"))
    }
}


def build(name: str) -> nn.Module:
    with seeded_init(0):
        return FAMILIES[name][0]().eval()  # eval: no dropout anywhere


def logits(output: Any) -> torch.Tensor:
    out: torch.Tensor = output.logits if hasattr(output, "logits") else output
    return out


def loss_of(output: Any, targets: torch.Tensor) -> torch.Tensor:
    z = logits(output)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1))


def call(model: Any, name: str, x: torch.Tensor) -> Any:
    """The model on token ids ``x`` (an encoder-decoder reads them as the decoder's inputs too)."""
    return model(input_ids=x, decoder_input_ids=x) if FAMILIES[name][3] else model(x)


def batch(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = torch.randint(1, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return seqs[:, :-1], seqs[:, 1:]


def one_process(name: str) -> dict[str, torch.Tensor]:
    net, (x, y) = build(name), batch()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        loss_of(call(net, name, x), y).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def wrapped(backend: CommunicationBackend, name: str, how: str) -> tuple[Any, Any]:
    net = build(name)
    if how == "tp2":
        model: Any = TensorParallelModel(net, backend, plan=HAND_PLANS.get(name, "auto"))
        return model, DDPOptimizer(model, torch.optim.SGD, lr=LR)
    if how == "pp2":
        model = PipelineParallelModel(net, backend, micro_batches=2, split_points=[FAMILIES[name][2]])
        return model, DDPOptimizer(model, torch.optim.SGD, lr=LR)
    if how == "zero3":
        model = ZeRO3Model(net, backend, persistence_threshold=0)
    else:
        layer = next(type(m) for m in net.modules() if type(m).__name__ == FAMILIES[name][1])
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((layer,)))
    return model, ZeRO3Optimizer(model, torch.optim.SGD, lr=LR)


def train(backend: CommunicationBackend, name: str, how: str) -> dict[str, torch.Tensor]:
    model, opt = wrapped(backend, name, how)
    x, y = batch()
    if how in ("zero3", "fsdp"):  # data parallel: this rank's half of the batch
        x, y = x.chunk(2)[backend.rank], y.chunk(2)[backend.rank]
    for _ in range(STEPS):
        if how == "pp2":
            model.train_step((x, y), loss_of)
        else:
            loss_of(call(model, name, x), y).backward()
        opt.step()
        opt.zero_grad()
    state: dict[str, torch.Tensor] = model.full_state_dict()
    return state


def on_meta(backend: CommunicationBackend, name: str, how: str) -> tuple[dict[str, Any], float]:
    with torch.device("meta"):
        net = FAMILIES[name][0]().eval()
    if how == "tp2":
        model: Any = TensorParallelModel(net, backend, plan=HAND_PLANS.get(name, "auto"), init_seed=3)
    else:
        model = ZeRO3Model(net, backend, persistence_threshold=0, init_seed=3)
    buffers = {k: b.clone() for k, b in net.named_buffers()}
    x, y = batch(2)
    return {"state": model.full_state_dict(), "buffers": buffers}, loss_of(call(model, name, x), y).item()


def refused(exc: BaseException) -> str:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    kind = "refused" if isinstance(cause, DtlabError) else f"raw {type(cause).__name__}"
    return f"{kind}: {str(cause)[:160]}"


def strategy_cell(name: str, how: str, want: dict[str, torch.Tensor]) -> str:
    try:
        states = run_world(2, train, name, how, timeout=300)
    except Exception as exc:  # what stopped the run is the cell
        return refused(exc)
    worst = 0.0
    for state in states:
        for k, v in want.items():
            if v.is_floating_point() and float(v.norm()) > 1e-2:
                worst = max(worst, float((state[k] - v).norm() / v.norm()))
    return f"{worst:.1e}"


def meta_cell(name: str, tp_cell: str) -> str:
    how = "tp2" if not tp_cell.startswith(("refused", "raw")) else "zero3"
    try:
        (got, loss), (z3, _) = (run_world(2, on_meta, name, h, timeout=300)[0] for h in (how, "zero3"))
    except Exception as exc:
        return refused(exc)
    plain = build(name)
    plain.load_state_dict(z3["state"])
    x, y = batch(2)
    want = loss_of(call(plain, name, x), y).item()
    same = all(torch.equal(got["state"][k], v) for k, v in z3["state"].items())
    bufs = all(torch.equal(got["buffers"].get(k, v + 1), v) for k, v in plain.named_buffers())
    verdict = "exact" if same and bufs and abs(loss - want) <= 1e-6 * abs(want) else "DIFFERS"
    return f"{verdict} ({how}: state = ZeRO-3's {same}, buffers {bufs}, loss {loss:.6f} vs {want:.6f})"


def hybrid(backend: CommunicationBackend, name: str, axes: dict[str, int], dp: str, meta: bool) -> Any:
    """The trained full state on a mesh, or (``meta``) the state built on meta with ``init_seed``."""
    if meta:
        with torch.device("meta"):
            net = FAMILIES[name][0]().eval()
    else:
        net = build(name)
    layer = next(type(m) for m in net.modules() if type(m).__name__ == FAMILIES[name][1])
    options: dict[str, Any] = {"init_seed": 3} if meta else {}
    if "pp" in axes:
        options.update(split_points=[FAMILIES[name][2]], micro_batches=2)
    if dp == "fsdp":
        options["wrap_policy"] = ModuleClassPolicy((layer,))
    mesh = Mesh(backend, axes)
    model = HybridShardedModel(net, mesh, dp, tensor_plan="auto", **options)
    if meta:
        return model.full_state_dict()
    opt = (ZeRO3Optimizer if dp == "fsdp" else ZeRO1Optimizer)(model, torch.optim.SGD, lr=LR)
    x, y = batch()
    x, y = x.chunk(mesh.size("dp"))[mesh.coordinate("dp")], y.chunk(mesh.size("dp"))[mesh.coordinate("dp")]
    for _ in range(STEPS):
        if model.pipelined:
            model.train_step((x, y), loss_of)
        else:
            loss_of(call(model, name, x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def zero3_on_meta(backend: CommunicationBackend, name: str) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        net = FAMILIES[name][0]().eval()
    state: dict[str, torch.Tensor] = ZeRO3Model(
        net, backend, persistence_threshold=0, init_seed=3
    ).full_state_dict()
    return state


def main_hybrid(names: list[str]) -> None:
    meshes = [
        ({"dp": 2, "tp": 2}, "fsdp"),
        ({"pp": 2, "dp": 2, "tp": 2}, "fsdp"),
        ({"pp": 2, "dp": 2, "tp": 2}, "zero1"),
    ]
    print(
        "| family | "
        + " | ".join(f"{'x'.join(f'{k}{v}' for k, v in a.items())} {dp}" for a, dp in meshes)
        + " | meta pp2xdp2xtp2 fsdp |"
    )
    print("|---" * (len(meshes) + 2) + "|")
    for name in names:
        want, cells = one_process(name), []
        for axes, dp in meshes:
            try:
                states = run_world(math.prod(axes.values()), hybrid, name, axes, dp, False, timeout=300)
            except Exception as exc:  # what stopped the run is the cell
                cells.append(refused(exc))
                continue
            worst = max(
                float((s[k] - v).norm() / v.norm())
                for s in states
                for k, v in want.items()
                if v.is_floating_point() and float(v.norm()) > 1e-2
            )
            cells.append(f"{worst:.1e}")
        try:
            reference = run_world(2, zero3_on_meta, name, timeout=300)[0]
            states = run_world(8, hybrid, name, {"pp": 2, "dp": 2, "tp": 2}, "fsdp", True, timeout=300)
            same = all(torch.equal(s[k], v) for s in states for k, v in reference.items())
            cells.append("= ZeRO-3's, bitwise" if same else "DIFFERS")
        except Exception as exc:
            cells.append(refused(exc))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main(names: list[str]) -> None:
    print("| family | " + " | ".join(STRATEGIES) + " | meta |")
    print("|---" * (len(STRATEGIES) + 2) + "|")
    for name in names:
        want = one_process(name)
        cells = [strategy_cell(name, how, want) for how in STRATEGIES]
        cells.append(meta_cell(name, cells[0]))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--hybrid"]
    if "--hybrid" in sys.argv:
        main_hybrid(args or [n for n in FAMILIES if n != "T5"])  # T5 declares no tensor plan
    else:
        main(args or list(FAMILIES))
