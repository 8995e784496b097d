"""2-D parallelism against torch's composite: dtlab's ``HybridShardedModel(net, mesh, "fsdp",
tensor_plan=transformer_plan())`` on dp x tp against torch's FSDP2 over TP (torchtitan's order:
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` per block over the mesh's ``tp``
dimension, then ``fully_shard`` per block and on the root over ``dp``, one
``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``), in the same Gloo processes.

    .venv/bin/python -m dtlab.benchmarks.hybrid_vs_torch                    # dp=2 x tp=2, defaults below
    .venv/bin/python -m dtlab.benchmarks.hybrid_vs_torch --rounds 20 --steps 3 --json out.json
    .venv/bin/python -m dtlab.benchmarks.hybrid_vs_torch --model llama      # the Hugging Face Llama

Model: the built-in ``TransformerLM`` of ``dtlab.benchmarks.tensor`` (d_model 256, 2 layers), split the
same way on both sides (heads and MLP; the token embedding and the head by vocabulary, the loss
vocabulary-parallel: ``model.cross_entropy`` / ``loss_parallel()``), each transformer block one
FSDP unit; or (``--model llama``) the ``LlamaForCausalLM`` of ``dtlab.benchmarks.hf_tensor``, split by
its own plan on both sides (``tensor_plan="auto"``; ``parallelize_module`` with the same styles), each
decoder layer one FSDP unit, the logits gathered. Both from the same initial weights; the global batch
(``--batch`` sequences) split over dp, the same on the tp ranks of a dp rank; AdamW (``--lr``). A step:
forward, loss, backward, optimizer step.

First ``--loss-steps`` steps of both, and of one plain process on the global batch (rank 0): the
global loss of every step and the largest relative difference between each pair. Then the two
alternate in blocks of ``--steps`` steps (``--rounds`` rounds, the order reversed every other round,
after ``--warmup`` steps each), each step timed as the slowest rank's: the median step (IQR), the ratio
of medians and the median of the per-round ratios. Bytes sent per rank per step: dtlab's
``backend.stats``; torch's counted by a dispatch mode (``_torch_comm.TorchCollectives``, dtlab's ring
convention). Model state per rank: parameters, gradients and optimizer state held after backward and
after the optimizer step, read from the tensors (a DTensor's local part; dtlab's ``memory_report()``).
``--profile`` also prints each side's top operators by self CPU time on rank 0 (one block of steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._hf_llama import LLAMA_KEYS, add_llama_args
from dtlab.benchmarks._paired import (
    TP_TRANSFORMER,
    add_timing_args,
    add_tp_transformer_args,
    alternate,
    profile_table,
    quartiles,
    round_ratios,
)

if TYPE_CHECKING:  # imported where used: the command line parses its arguments without torch
    import torch

    from dtlab.backends.base import CommunicationBackend


class Side:
    """One implementation's step: ``forward_backward()`` (this dp rank's loss), then ``opt``'s step;
    ``state_bytes()``: the parameters, gradients and optimizer state this rank holds now. (A plain
    class: a spawned world runs this module as its ``__main__`` without registering it, which
    ``dataclass`` needs.)"""

    def __init__(
        self, forward_backward: Callable[[], float], opt: Any, state_bytes: Callable[[], int]
    ) -> None:
        self.forward_backward = forward_backward
        self.opt = opt  # a torch optimizer or a dtlab optimizer strategy
        self.state_bytes = state_bytes

    def step(self, probe: list[int] | None = None) -> float:
        loss = self.forward_backward()
        if probe is not None:
            probe.append(self.state_bytes())
        self.opt.step()
        if probe is not None:
            probe.append(self.state_bytes())
        self.opt.zero_grad()
        return loss


def dp_share(x: torch.Tensor, dp: int, coordinate: int) -> torch.Tensor:
    """Rank ``coordinate``'s part of the global batch ``x`` over ``dp`` ranks."""
    return x.chunk(dp)[coordinate]


class Model:
    """What the two models differ in: ``build(args)``, ``batch(args)`` (the global batch), the FSDP
    ``unit`` class, dtlab's ``plan``, whether the logits stay split over tp (``split``: the loss
    vocabulary-parallel on both sides) and torch's ``parallelize(net, tp_mesh)``."""

    build: Callable[[dict[str, Any]], torch.nn.Module]
    batch: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]
    unit: type[torch.nn.Module]
    plan: Any  # "auto" or dtlab's declared plan
    split: bool
    parallelize: Callable[[Any, Any], None]

    def __init__(self, args: dict[str, Any]) -> None:
        if args["model"] == "llama":
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            from dtlab.benchmarks._hf_llama import llama, token_batch
            from dtlab.benchmarks.hf_tensor import parallelize_llama

            self.build, self.batch, self.unit = llama, token_batch, LlamaDecoderLayer
            self.plan = "auto"
            self.split, self.parallelize = False, parallelize_llama
        else:
            from dtlab.benchmarks.tensor import parallelize_transformer, tp_batch, transformer
            from dtlab.models import transformer_plan
            from dtlab.trainers.models import Block

            self.build, self.batch, self.unit = transformer, tp_batch, Block
            self.plan, self.split, self.parallelize = transformer_plan(), True, parallelize_transformer


def dtlab_side(backend: CommunicationBackend, args: dict[str, Any]) -> Side:
    """``HybridShardedModel`` with FSDP over dp (each block a unit) and the model's plan over tp."""
    import torch

    from dtlab.backends import Mesh
    from dtlab.benchmarks._hf_llama import lm_loss
    from dtlab.models import HybridShardedModel, ModuleClassPolicy
    from dtlab.optimizers import ZeRO3Optimizer

    spec = Model(args)
    mesh = Mesh(backend, {"dp": args["dp"], "tp": args["tp"]})
    policy = ModuleClassPolicy((spec.unit,))
    model = HybridShardedModel(spec.build(args), mesh, "fsdp", tensor_plan=spec.plan, wrap_policy=policy)
    opt = ZeRO3Optimizer(model, torch.optim.AdamW, lr=args["lr"])
    x, y = (dp_share(t, args["dp"], mesh.coordinate("dp")) for t in spec.batch(args))
    loss_of = model.cross_entropy if spec.split else lm_loss

    def forward_backward() -> float:
        loss = loss_of(model(x), y)
        loss.backward()
        return float(loss)

    def state_bytes() -> int:
        rep = opt.memory_report()
        return int(rep["parameters"] + rep["gradients"] + rep["optimizer_state"])

    return Side(forward_backward, opt, state_bytes)


def torch_2d(
    net: torch.nn.Module,
    dp: int,
    tp: int,
    unit: type[torch.nn.Module],
    parallelize: Callable[[Any, Any], None],
) -> torch.nn.Module:
    """torch's 2-D composite of ``net`` (in place): DTensor TP over the mesh's tp dimension
    (``parallelize(net, tp_mesh)``), then ``fully_shard`` on every ``unit`` and the root over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(net, mesh["tp"])
    for sub in net.modules():
        if isinstance(sub, unit):
            fully_shard(sub, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net


def torch_side(backend: CommunicationBackend, args: dict[str, Any]) -> Side:
    import torch

    from dtlab.benchmarks._hf_llama import lm_loss
    from dtlab.benchmarks._strategies_run import tensor_bytes
    from dtlab.benchmarks.tensor import loss_parallel_backward

    spec = Model(args)
    net = torch_2d(spec.build(args), args["dp"], args["tp"], spec.unit, spec.parallelize)
    opt = torch.optim.AdamW(net.parameters(), lr=args["lr"])
    coordinate = backend.rank // args["tp"]  # init_device_mesh lays ranks out row-major, as dtlab's Mesh
    x, y = (dp_share(t, args["dp"], coordinate) for t in spec.batch(args))
    params = list(net.parameters())

    def whole_logits() -> float:
        loss = lm_loss(net(x), y)
        loss.backward()
        return float(loss)

    def state_bytes() -> int:
        held = tensor_bytes(params) + tensor_bytes(p.grad for p in params)
        return held + tensor_bytes(v for s in opt.state.values() for v in s.values())

    forward_backward = loss_parallel_backward(net, x, y) if spec.split else whole_logits
    return Side(forward_backward, opt, state_bytes)


def plain_losses(args: dict[str, Any]) -> list[float]:
    """One process on the global batch: ``args["loss_steps"]`` steps of the same model and optimizer."""
    import torch

    from dtlab.benchmarks._hf_llama import lm_loss

    spec = Model(args)
    net = spec.build(args)
    opt = torch.optim.AdamW(net.parameters(), lr=args["lr"])
    x, y = spec.batch(args)
    losses = []
    for _ in range(args["loss_steps"]):
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def global_loss(backend: CommunicationBackend, loss: float) -> float:
    """The global batch's loss from each rank's dp share's (every tp rank holds its dp rank's)."""
    import torch

    t = torch.tensor([loss], dtype=torch.float64)
    backend.all_reduce(t)
    return float(t.item()) / backend.world_size


def bench_world(backend: CommunicationBackend, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: the losses of the first steps, bytes and state of one step each, then the timed rounds."""
    import torch

    from dtlab.benchmarks._torch_comm import TorchCollectives

    torch.set_num_threads(args["threads"])
    sides = {"dtlab": dtlab_side(backend, args), "torch": torch_side(backend, args)}
    losses = {
        n: [global_loss(backend, s.step()) for _ in range(args["loss_steps"])] for n, s in sides.items()
    }
    if backend.rank == 0:
        losses["plain"] = plain_losses(args)
    state: dict[str, list[int]] = {n: [] for n in sides}
    backend.stats.reset()
    sides["dtlab"].step(state["dtlab"])
    ops = backend.stats.snapshot()
    dtlab_sent = {
        "sent": backend.stats.bytes_sent,
        "calls": {k: v["calls"] for k, v in ops.items()},
        "per_kind": {k: v["bytes_sent"] for k, v in ops.items()},
    }
    counter = TorchCollectives()
    with counter:
        sides["torch"].step(state["torch"])
    torch_sent = {"sent": counter.bytes_sent, "calls": counter.calls, "per_kind": counter.sent}
    variants: dict[str, Callable[[], float]] = {n: s.step for n, s in sides.items()}
    times = alternate(backend, variants, args["rounds"], args["steps"], args["warmup"])
    profiles = {n: profile_table(s, args["steps"]) for n, s in variants.items()} if args["profile"] else {}
    return {
        "profiles": profiles,
        "times": times,
        "losses": losses,
        "bytes": {"dtlab": dtlab_sent, "torch": torch_sent},
        "state": {n: max(v) for n, v in state.items()},
    }


def largest_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def report(results: list[dict[str, Any]], args: dict[str, Any]) -> None:
    """The tables of the measurements (``results``: every rank's, rank 0's times and losses); a count
    that differs between ranks is shown as its values joined by ``/``."""
    res, names = results[0], ("dtlab", "torch")
    times: dict[str, list[float]] = res["times"]
    med = {n: statistics.median(times[n]) for n in names}
    paired = round_ratios(times["dtlab"], times["torch"], args["steps"])
    cfg = ", ".join(f"{k}={v}" for k, v in args.items())
    print(f"\ndp={args['dp']} x tp={args['tp']} on Gloo; {cfg}\n")
    print(
        "| implementation | step, median (IQR) | step, best | sent per rank per step | collectives per step "
        "| params + grads + optimizer state per rank |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for n in names:
        lo, hi = quartiles(times[n])
        sent = [r["bytes"][n]["sent"] for r in results]
        shown = "not counted" if None in sent else "/".join(sorted({f"{s:,}" for s in sent})) + " B"
        kinds = res["bytes"][n]
        calls = ", ".join(
            f"{k} {v}" + (f" ({kinds['per_kind'][k]:,} B)" if k in kinds["per_kind"] else "")
            for k, v in sorted(kinds["calls"].items())
        )
        held = "/".join(sorted({f"{r['state'][n]:,}" for r in results})) + " B"
        print(
            f"| {n} | {1e3 * med[n]:.0f} ms ({1e3 * lo:.0f}-{1e3 * hi:.0f}) | {1e3 * min(times[n]):.0f} ms "
            f"| {shown} | {calls} | {held} |"
        )
    lo, hi = quartiles(paired)
    print(
        f"\ndtlab / torch: ratio of medians {med['dtlab'] / med['torch']:.2f}; per round (block medians) "
        f"median {statistics.median(paired):.2f} (IQR {lo:.2f}-{hi:.2f}) over {len(paired)} rounds"
    )
    losses: dict[str, list[float]] = res["losses"]
    print("\n| step | " + " | ".join(losses) + " |\n|---|" + "---:|" * len(losses))
    for i in range(args["loss_steps"]):
        print(f"| {i + 1} | " + " | ".join(f"{v[i]:.7f}" for v in losses.values()) + " |")
    pairs = [("dtlab", "torch"), ("dtlab", "plain"), ("torch", "plain")]
    print(
        "\nlargest relative difference: "
        + ", ".join(f"{a} vs {b} {largest_rel(losses[a], losses[b]):.1e}" for a, b in pairs)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(  # resolve: the Llama's --layers --heads --batch --seq (same defaults)
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    parser.add_argument("--model", choices=("transformer", "llama"), default="transformer")
    add_tp_transformer_args(parser)
    add_llama_args(parser, layers=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--loss-steps", type=int, default=5, help="steps whose losses are compared")
    add_timing_args(parser, steps=3, rounds=10)
    parser.add_argument("--profile", action="store_true", help="print each variant's top operators (rank 0)")
    ns = parser.parse_args(argv)
    sizes = LLAMA_KEYS if ns.model == "llama" else TP_TRANSFORMER
    keys = (
        "model",
        *sizes,
        "tp",
        "dp",
        "lr",
        "loss_steps",
        "steps",
        "rounds",
        "warmup",
        "threads",
        "profile",
    )
    args = {k: getattr(ns, k) for k in keys}

    from dtlab.testing import spawn_world

    world = ns.dp * ns.tp
    results = spawn_world(world, bench_world, args, backend="gloo", timeout=3600, check_collectives=False)
    report(results, args)
    for name, table in results[0]["profiles"].items():
        print(f"\n{name}: top operators by self CPU time, rank 0, {ns.steps} steps\n{table}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": args, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
