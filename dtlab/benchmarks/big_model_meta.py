"""A model too big to build whole on every rank: an HF Llama of ~1.6B parameters (6.4 GB in float32,
four whole copies 26 GB on a 23 GB machine) built on the meta device, sharded over 4 Gloo ranks with
FSDP (one unit per decoder layer and one for the embedding), loaded with ``load_pretrained`` from the
sharded safetensors checkpoint ``save_pretrained`` wrote, then trained a few plain-SGD steps.

    .venv/bin/python -m dtlab.benchmarks.big_model_meta                 # the 1.6B model, 4 ranks
    .venv/bin/python -m dtlab.benchmarks.big_model_meta --layers 2 --hidden 256 --intermediate 512 \\
        --vocab 1000 --heads 4                                    # a quick check of the script

1. One process builds the model plainly under ``seeded_init(0)``, computes the loss of one forward on
   the batch (the reference), and writes it with ``save_pretrained(max_shard_size=...)``; it exits,
   so its memory is returned.
2. ``--ranks`` Gloo processes each build the model on meta, wrap it in ``FSDPModel(init_seed=0,
   param_init_fn=<HF _init_weights>)`` (each rank materializes its shards, one module whole at a
   time), ``load_pretrained`` the checkpoint (each rank reads its slices), and train ``--steps`` steps
   on its row of the batch, with bfloat16 parameters by default (``--dtype``; the float32 checkpoint
   is converted as it loads, and the reference forward runs on the same converted weights) so that
   the sharded state fits. The first step's loss (averaged over the ranks) is the loaded weights'
   loss: it must match the reference forward's.

Printed: every rank's peak RSS after construction, after loading and after training (``ru_maxrss``:
the high-water mark so far), the job's peak (the sum of the ranks' RSS sampled every 0.2 s by this
process) and the sum and max of the ranks' peaks, with the time of each phase. The checkpoint (written
under ``--dir``, default a new folder in /tmp) is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.benchmarks._hf_llama import llama_config

if TYPE_CHECKING:  # imported where used: the parent process never imports torch
    import torch
    import transformers

    from dtlab.backends.base import CommunicationBackend


def _config(args: dict[str, Any]) -> transformers.LlamaConfig:
    return llama_config(args, bos_token_id=0, eos_token_id=0)  # as many key/value heads as heads


def _batch(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    seqs = torch.randint(
        0, args["vocab"], (args["ranks"], args["seq"] + 1), generator=torch.Generator().manual_seed(1)
    )
    return seqs[:, :-1], seqs[:, 1:]


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch

    logits = net(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def _write(backend: CommunicationBackend, args: dict[str, Any], folder: str) -> dict[str, Any]:  # noqa: ARG001 - spawn_world's signature
    import torch
    import transformers

    from dtlab.core import seeded_init

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    with seeded_init(0):
        net = transformers.LlamaForCausalLM(_config(args))
    built = time.perf_counter()
    x, y = _batch(args)
    net.save_pretrained(folder, max_shard_size=args["shard_size"])
    net.to(getattr(torch, args["dtype"]))  # the weights as the ranks hold them once loaded
    with torch.no_grad():
        loss = _loss(net, x, y).item()
    return {
        "parameters": sum(p.numel() for p in net.parameters()),
        "loss": loss,
        "peak_mb": _peak_mb(),
        "build_s": built - t0,
        "write_s": time.perf_counter() - built,
    }


def _train(backend: CommunicationBackend, args: dict[str, Any], folder: str) -> dict[str, Any]:
    import torch
    import transformers
    from torch import nn

    from dtlab.checkpoint import load_pretrained
    from dtlab.models import FSDPModel, ModuleClassPolicy
    from dtlab.optimizers import ZeRO3Optimizer

    torch.set_num_threads(1)
    out: dict[str, Any] = {"start_mb": _peak_mb()}
    t0 = time.perf_counter()
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(_config(args)).to(getattr(torch, args["dtype"]))
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    model = FSDPModel(
        net,
        backend,
        wrap_policy=ModuleClassPolicy((layer, nn.Embedding)),
        prefetch=False,  # one unit gathered at a time (the next one is not fetched ahead)
        init_seed=0,
        param_init_fn=net._init_weights,  # noqa: SLF001 - Hugging Face's initializer (rotary inv_freq too)
    )
    out["held_parameters_mb"] = model.memory_report()["parameters"] / 2**20
    out["construct_mb"], t1 = _peak_mb(), time.perf_counter()
    report = load_pretrained(model, folder)
    out["load_mb"], t2 = _peak_mb(), time.perf_counter()
    out["report"] = (report.missing, report.unexpected, report.mismatched)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=args["lr"])
    x, y = _batch(args)
    r = backend.rank
    losses = []
    for _ in range(max(1, args["steps"])):
        with torch.set_grad_enabled(args["steps"] > 0):  # --steps 0: one forward, the loaded weights' loss
            loss = _loss(model, x[r : r + 1], y[r : r + 1])
        if args["steps"] > 0:
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean = loss.detach().reshape(1).double()
        backend.all_reduce(mean)
        losses.append(mean.item() / backend.world_size)
    out["train_mb"], t3 = _peak_mb(), time.perf_counter()
    out["losses"] = losses
    out["seconds"] = {"construct": t1 - t0, "load": t2 - t1, "train": t3 - t2}
    return out


def _status(pid: str) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _children(parent: int) -> list[int]:
    """The PIDs of ``parent``'s direct children (the rank processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _status(entry).get("PPid", "0").strip() == str(parent):
            out.append(int(entry))
    return out


def _children_rss_mb(parent: int) -> float:
    """The summed RSS of ``parent``'s direct children."""
    total = 0
    for pid in _children(parent):
        rss = _status(str(pid)).get("VmRSS")
        total += int(rss.split()[0]) if rss else 0
    return total / 1024


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


class _Sampler:
    """The peak of the ranks' summed RSS, sampled in a thread while a world runs."""

    def __init__(self, floor_mb: float) -> None:
        self.peak, self.floor_mb, self.aborted = 0.0, floor_mb, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, _children_rss_mb(me))
            if _available_mb() < self.floor_mb:  # the machine is shared: give up before the OOM killer
                self.aborted = True
                for pid in _children(me):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> _Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="0: one forward without gradients, no step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the parameters on the ranks (the checkpoint is float32; loading converts)",
    )
    ap.add_argument("--shard-size", default="1GB", help="save_pretrained's max_shard_size")
    ap.add_argument(
        "--dir", default=None, help="where the checkpoint is written (default: a new /tmp folder)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument(
        "--floor-gb",
        type=float,
        default=1.5,
        help="kill the ranks when the machine's available memory falls below this (a shared machine)",
    )
    ns = ap.parse_args()
    args = vars(ns)

    from dtlab.errors import RankFailedError
    from dtlab.testing.spawn import spawn_world

    folder = Path(ns.dir) if ns.dir else Path(tempfile.mkdtemp(prefix="dtlab-big-model-"))
    try:
        with _Sampler(ns.floor_gb * 1024) as writer_rss:
            wrote = spawn_world(1, _write, args, str(folder), timeout=ns.timeout, check_collectives=False)[0]
        files = sorted(folder.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"written: {wrote['parameters'] / 1e9:.3f}B parameters, {size / 2**30:.2f} GiB in "
            f"{len(files)} files "
            f"(build {wrote['build_s']:.0f} s, write {wrote['write_s']:.0f} s, peak RSS "
            f"{wrote['peak_mb'] / 1024:.2f} GiB), reference loss {wrote['loss']:.6f}"
        )
        with _Sampler(ns.floor_gb * 1024) as job:
            try:
                ranks = spawn_world(
                    ns.ranks, _train, args, str(folder), timeout=ns.timeout, check_collectives=False
                )
            except RankFailedError:
                if job.aborted:
                    sys.exit(
                        f"stopped: the machine's available memory fell below {ns.floor_gb} GiB (the ranks' "
                        f"summed RSS peaked at {job.peak / 1024:.2f} GiB)"
                    )
                raise
    finally:
        if not ns.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"{'rank':>4} {'held params':>12} {'construct':>10} {'load':>10} {'train':>10}"
        "  (peak RSS so far, GiB)"
    )
    for r, res in enumerate(ranks):
        print(
            f"{r:>4} {res['held_parameters_mb'] / 1024:>11.2f}G {res['construct_mb'] / 1024:>10.2f} "
            f"{res['load_mb'] / 1024:>10.2f} {res['train_mb'] / 1024:>10.2f}"
        )
    peaks = [res["train_mb"] / 1024 for res in ranks]
    secs = ranks[0]["seconds"]
    losses = ranks[0]["losses"]
    rel = abs(losses[0] - wrote["loss"]) / abs(wrote["loss"])
    print(
        f"job: peak of the summed RSS {job.peak / 1024:.2f} GiB; ranks' peaks: sum {sum(peaks):.2f} GiB, "
        f"max {max(peaks):.2f} GiB; one whole float32 copy {wrote['parameters'] * 4 / 2**30:.2f} GiB"
    )
    print(
        f"time (rank 0): construct {secs['construct']:.0f} s, load {secs['load']:.0f} s, "
        f"{ns.steps} steps {secs['train']:.0f} s"
    )
    print(
        f"losses {[f'{v:.6f}' for v in losses]}; loaded weights' loss vs the reference forward: rel {rel:.2e}"
    )
    print(f"load report: {ranks[0]['report']}")
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {
                    "args": args,
                    "write": wrote,
                    "ranks": ranks,
                    "job_peak_mb": job.peak,
                    "writer_peak_mb": writer_rss.peak,
                },
                indent=1,
            )
        )
    if rel > (1e-4 if ns.dtype == "float32" else 2e-2) or any(res["report"] != ([], [], []) for res in ranks):
        sys.exit("the loaded weights' loss differs from the reference forward's, or keys did not match")


if __name__ == "__main__":
    main()
