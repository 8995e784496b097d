"""Convergence of every compression algorithm against dense, on real data, at densities 1% and 2%.

    .venv/bin/python -m dtlab.benchmarks.convergence                 # both tasks, 4 in-memory ranks
    .venv/bin/python -m dtlab.benchmarks.convergence --task digits --epochs 10
    .venv/bin/python -m dtlab.benchmarks.convergence --task lm --seed 1   # another init and data order

Tasks (offline, real data):

* ``digits``: a small CNN on scikit-learn's bundled 8x8 handwritten digits (1257 train / 180
  validation / 360 test images); reported: final validation and test accuracy.
* ``lm``: a byte-level GRU language model on the Python standard library's source (dtlab's
  ``stdlib`` corpus, 80% train / 10% validation / 10% test windows); reported: validation and test
  perplexity.

Recipes are chosen on the validation split and reported on the test split
(``dtlab/benchmarks/convergence_protocol.py`` runs that protocol over 3 seeds).

Every run is DDP on ``--world`` in-memory ranks (threads) with ``GradientCompressionOptimizer``
(one bucket for the whole model, so ``k = density x all parameters``, as in the Ok-Topk reference
code), the same initial weights, the same global batches, SGD with momentum, and the same number of
dense warm-up iterations for every compressor. Loss curves are written as PNG plots.

Per-task defaults (``TASK_DEFAULTS``, each overridable): digits 30 epochs, lr 0.05 constant, 20
warm-up iterations; lm 16 epochs, lr 1.0 cosine-decayed to 0, 262 warm-up iterations (2 epochs),
momentum 0.9 by DGC's momentum correction (``--no-momentum-correction``: by the SGD optimizer).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import Compressor, NonFiniteGradientError, make_compressor
from dtlab.models import DDPModel
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.optimizers.ddp import DDPOptimizer
from dtlab.testing import run_world

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {
        "epochs": 30,
        "lr": 0.05,
        "schedule": "constant",
        "warmup": 20,
        "ramp": 0,
        "momentum_correction": False,
    },
    "lm": {
        "epochs": 16,
        "lr": 1.0,
        "schedule": "cosine",
        "warmup": 262,
        "ramp": 0,
        "momentum_correction": True,
    },
}
SPARSE = ["topka", "topkdsa", "gtopk", "gaussiank", "oktopk"]
SPARSE_EXTRA = ["randomk"]
OTHERS = ["qsgd", "powersgd", "fp16"]


def make(name: str, density: float, warmup: int, tau: int | None = None, ramp: int = 0) -> Compressor:
    """``warmup`` dense iterations for every compressor, then for the sparse ones ``ramp`` iterations
    of DGC's density ramp; PowerSGD at rank 4; Ok-Topk's tau' = 2 tau."""
    taus = {} if tau is None else {"tau": tau, "tau_prime": 2 * tau}
    return make_compressor(name, density=density, warmup_steps=warmup, ramp_steps=ramp, rank=4, **taus)


# ---------------------------------------------------------------------------------------------- tasks
def digits_task(seed: int = 0) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    torch.manual_seed(seed)  # the initial weights (the train/test split does not depend on it)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip
    train, val, test = (x[:1257], y[:1257]), (x[1257:1437], y[1257:1437]), (x[1437:], y[1437:])
    return {"net": net, "train": train, "val": val, "test": test, "batch": 64, "momentum": 0.9}


def lm_task(max_bytes: int = 300_000, seq: int = 64, seed: int = 0, hidden: int = 128) -> dict[str, Any]:
    from dtlab.data.corpus import load_stdlib_corpus

    data = torch.frombuffer(bytearray(load_stdlib_corpus(max_bytes)), dtype=torch.uint8).long()
    n = (data.numel() - 1) // seq
    inputs, targets = data[: n * seq].view(n, seq), data[1 : n * seq + 1].view(n, seq)
    cut, test_cut = int(0.8 * n), int(0.9 * n)
    torch.manual_seed(seed)
    return {
        "net": ByteGRU(hidden=hidden),
        "train": (inputs[:cut], targets[:cut]),
        "val": (inputs[cut:test_cut], targets[cut:test_cut]),
        "test": (inputs[test_cut:], targets[test_cut:]),
        "batch": 32,
        "momentum": 0.9,
    }


class ByteGRU(nn.Module):
    def __init__(self, emb: int = 48, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, emb)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(x))
        logits: torch.Tensor = self.out(h)
        return logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------- training
def lr_at(task: dict[str, Any], it: int, total: int) -> float:
    """The learning rate of iteration ``it`` of ``total``: constant, or cosine-decayed to 0."""
    if task.get("schedule", "constant") == "constant":
        return float(task["lr"])
    return float(task["lr"]) * 0.5 * (1.0 + math.cos(math.pi * it / total))


def iterations_per_epoch(task: dict[str, Any]) -> int:
    """Global batches per epoch (the last partial batch is dropped)."""
    n, gb = len(task["train"][1]), int(task["batch"])
    return (n - gb) // gb + 1


def train_rank(
    backend: CommunicationBackend, task: dict[str, Any], name: str, density: float, epochs: int, warmup: int
) -> dict[str, Any]:
    net = copy.deepcopy(task["net"])
    corrected = task.get("momentum_correction", False) and task["momentum"] > 0
    momentum = 0.0 if corrected else task["momentum"]
    inner = DDPOptimizer(DDPModel(net, backend), torch.optim.SGD, lr=task["lr"], momentum=momentum)
    opt = GradientCompressionOptimizer(
        inner,
        make(name, density, warmup, task.get("tau"), task["ramp"]),
        dense_below=0,
        momentum_correction=task["momentum"] if corrected else None,
    )
    loss_fn = lm_loss if isinstance(net, ByteGRU) else nn.functional.cross_entropy
    x, y = task["train"]
    gb, p, r = task["batch"], backend.world_size, backend.rank
    per = gb // p
    total = epochs * iterations_per_epoch(task)
    losses: list[float] = []
    densities: list[float] = []
    sent: list[int] = []
    diverged: int | None = None
    for epoch in range(epochs):
        order = torch.randperm(
            len(y), generator=torch.Generator().manual_seed(epoch + 1_000_003 * task["seed"])
        )
        for start in range(0, len(y) - gb + 1, gb):
            idx = order[start + r * per : start + (r + 1) * per]
            for group in opt.optimizer.param_groups:
                group["lr"] = lr_at(task, len(losses), total)
            opt.zero_grad()
            try:
                losses.append(float(opt.model.train_step((x[idx], y[idx]), loss_fn)))
            except NonFiniteGradientError:  # every rank raises it at the same step (counts all-reduced)
                diverged = len(losses)
                break
            opt.step()
            densities.append(opt.statistics.get("density", opt.statistics.get("local_density", 1.0)))
            sent.append(opt.statistics.get("bytes_sent", 0))
        if diverged is not None:
            break
    out: dict[str, Any] = {"losses": losses, "density": densities, "bytes_sent": sent, "diverged": diverged}
    if r == 0 and diverged is None:
        for split in ("val", "test"):
            out[split] = evaluate(net, *task[split])
    return out


def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Perplexity (the LM) or accuracy in % (digits) of ``net`` on one split."""
    with torch.no_grad():
        logits = net(x)
    if isinstance(net, ByteGRU):
        return math.exp(float(lm_loss(logits, y)))
    return float((logits.argmax(1) == y).float().mean()) * 100


def run(task_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    if task_name == "digits":
        task = digits_task(args.seed)
    else:
        task = lm_task(args.corpus_bytes, seed=args.seed, hidden=args.hidden)
    task["seed"] = args.seed
    if args.batch is not None:
        task["batch"] = args.batch
    defaults = TASK_DEFAULTS[task_name]
    task["lr"] = args.lr if args.lr is not None else defaults["lr"]
    if args.momentum is not None:
        task["momentum"] = args.momentum
    if args.tau is not None:
        task["tau"] = args.tau
    task["schedule"] = args.schedule if args.schedule is not None else defaults["schedule"]
    mc = args.momentum_correction
    task["momentum_correction"] = mc if mc is not None else defaults["momentum_correction"]
    epochs = args.epochs if args.epochs is not None else defaults["epochs"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    if getattr(args, "warmup_epochs", None) is not None:
        warmup = round(args.warmup_epochs * iterations_per_epoch(task))
    task["ramp"] = args.ramp if args.ramp is not None else defaults["ramp"]
    if getattr(args, "ramp_epochs", None) is not None:
        task["ramp"] = round(args.ramp_epochs * iterations_per_epoch(task))
    runs = [("dense", 1.0)] if getattr(args, "dense", True) else []
    runs += [(a, d) for d in args.densities for a in [*SPARSE, *SPARSE_EXTRA] if a in args.algorithms]
    runs += [(a, 1.0) for a in OTHERS if a in args.algorithms]
    rows = []
    for name, density in runs:
        t0 = time.time()
        res = run_world(args.world, train_rank, task, name, density, epochs, warmup, timeout=3600)
        losses = [sum(r["losses"][i] for r in res) / len(res) for i in range(len(res[0]["losses"]))]
        dens = res[0]["density"][warmup:]
        row = {
            "task": task_name, "algorithm": name, "density": density, "losses": losses,
            "final": res[0].get("test"),
            "val": res[0].get("val"),
            "seed": args.seed,
            "recipe": {k: task[k] for k in ("lr", "schedule", "momentum", "momentum_correction", "ramp")}
            | {"warmup": warmup, "epochs": epochs, "batch": task["batch"]},
            "diverged_at": res[0]["diverged"],
            "mean_selected_density": sum(dens) / max(1, len(dens)),
            "mean_bytes_sent": sum(res[0]["bytes_sent"][warmup:]) / max(1, len(dens)),
            "total_bytes_sent": sum(res[0]["bytes_sent"]),  # warm-up included
            "seconds": time.time() - t0,
        }  # fmt: skip
        rows.append(row)
        metric = "accuracy %" if task_name == "digits" else "perplexity"
        final = "diverged" if row["final"] is None else f"val {row['val']:.3f} test {row['final']:.3f}"
        print(
            f"{task_name} {name:9s} density {density:<5} {metric} {final}  "
            f"(selected {row['mean_selected_density']:.4f}, {row['seconds']:.0f}s)",
            flush=True,
        )
    return rows


def plot(rows: list[dict[str, Any]], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = sorted({r["density"] for r in rows if r["task"] == task and r["density"] < 1})
    fig, axes = plt.subplots(
        1, max(1, len(densities)), figsize=(6 * max(1, len(densities)), 4), squeeze=False
    )
    for ax, d in zip(axes[0], densities or [1.0], strict=False):
        for r in rows:
            if r["task"] != task or (r["density"] != d and r["density"] != 1.0):
                continue
            w = 20
            ls = r["losses"]
            smooth = [
                sum(ls[max(0, i - w + 1) : i + 1]) / len(ls[max(0, i - w + 1) : i + 1])
                for i in range(len(ls))
            ]
            label = r["algorithm"] if r["density"] == 1.0 else f"{r['algorithm']} ({d:.0%})"
            if r.get("diverged_at") is not None:
                label += f", diverged at {r['diverged_at']}"
            style = "-" if r["algorithm"] in ("dense", "oktopk") else "--"
            ax.plot(smooth, style, label=label, linewidth=2 if r["algorithm"] in ("dense", "oktopk") else 1)
        ax.set_title(f"{task}: training loss, density {d:.0%} (moving average of 20 steps)")
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        # a diverging run would stretch the axis over dozens of decades: cap it at 3x the first loss
        first = [r["losses"][0] for r in rows if r["task"] == task and r["losses"]]
        if first:
            ax.set_ylim(top=3 * max(first))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["digits", "lm", "both"], default="both")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.02])
    ap.add_argument("--algorithms", nargs="+", default=[*SPARSE, *SPARSE_EXTRA, *OTHERS])
    ap.add_argument("--epochs", type=int, default=None, help="default: 30 (digits), 16 (lm)")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order (0: the docs' runs)")
    ap.add_argument("--batch", type=int, default=None, help="global batch; default 64 (digits), 32 (lm)")
    ap.add_argument("--hidden", type=int, default=128, help="lm: GRU hidden size (128: 113k parameters)")
    ap.add_argument("--corpus-bytes", type=int, default=300_000, help="lm: bytes of stdlib source used")
    ap.add_argument("--lr", type=float, default=None, help="default: 0.05 (digits), 1.0 (lm)")
    ap.add_argument("--momentum", type=float, default=None, help="SGD momentum; default 0.9")
    ap.add_argument(
        "--schedule",
        choices=["constant", "cosine"],
        default=None,
        help="learning rate: constant, or cosine decay to 0 over the run (every algorithm alike); "
        "default: constant (digits), cosine (lm)",
    )
    ap.add_argument(
        "--momentum-correction",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="momentum in the compressed reducer (DGC momentum correction + factor masking), inner "
        "SGD without momentum; every algorithm alike (for dense it is plain momentum SGD); "
        "default: off (digits), on (lm)",
    )
    ap.add_argument("--tau", type=int, default=None, help="Ok-Topk's tau (tau' = 2 tau); default 32")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="dense warm-up iterations, every compressor; default 20 (digits), 262 = 2 epochs (lm)",
    )
    ap.add_argument(
        "--ramp",
        type=int,
        default=None,
        help="sparse compressors: iterations of DGC's density ramp (25%%, 6.25%%, ... down to the "
        "density) after the dense warm-up (ramp_steps); default 0",
    )
    ap.add_argument(
        "--warmup-epochs", type=float, default=None, help="the warm-up in epochs (overrides --warmup)"
    )
    ap.add_argument("--ramp-epochs", type=float, default=None, help="the ramp in epochs (overrides --ramp)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    ap.add_argument(
        "--plot-tag",
        default="",
        help="plots go to compression_<task><tag>_loss.png (keep the full runs' plots)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for task in ["digits", "lm"] if args.task == "both" else [args.task]:
        rows += run(task, args)
        plot(rows, task, args.out_dir / f"compression_{task}{args.plot_tag}_loss.png")
    print("\n| task | algorithm | density | final | vs dense | selected density | bytes sent/step (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        dense = next(d for d in rows if d["task"] == r["task"] and d["algorithm"] == "dense")
        if r["final"] is None:
            final, diff = f"diverged (non-finite gradients at iteration {r['diverged_at']})", "-"
        elif r["task"] == "digits":
            final, diff = f"{r['final']:.3f}", f"{r['final'] - dense['final']:+.2f} points"
        else:
            final, diff = f"{r['final']:.3f}", f"{(r['final'] / dense['final'] - 1) * 100:+.2f}%"
        print(
            f"| {r['task']} | {r['algorithm']} | {r['density']} | {final} | {diff} | "
            f"{r['mean_selected_density']:.4f} | {r['mean_bytes_sent']:.0f} |"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps([{k: v for k, v in r.items() if k != "losses"} for r in rows], indent=1)
        )


if __name__ == "__main__":
    main()
