"""dtlab's data-parallel strategies against PyTorch's DistributedDataParallel and FSDP2 ``fully_shard``.

For a ~10M-parameter MLP and a small transformer, on 2 ranks (processes) over Gloo and over MPI:
step time (forward + backward + optimizer step, AdamW), bytes sent per rank per step (dtlab's
counters; torch's collectives are not counted), model-state memory per rank (parameters + gradients
+ optimizer state + peak gathered parameters, from the tensors) and the peak resident memory each
configuration added (Linux ``VmHWM`` over the RSS before building, measured in a fresh 2-process world
per configuration). Under Gloo the same processes also run torch DDP and torch FSDP2 on the same
process group. Results: docs/performance.md, "Strategies against torch DDP and FSDP2".

Configurations run interleaved, ``--rounds`` times, and each reports its median step time, so drift
in the machine's load hits every configuration alike. Run::

    python -m dtlab.benchmarks.strategies                 # both engines, both models
    python -m dtlab.benchmarks.strategies --engines gloo --models mlp --steps 5 --rounds 3
    python -m dtlab.benchmarks.strategies --engines gloo --strategies ddp,torch_ddp --skip-memory
    python -m dtlab.benchmarks.strategies --strategies ddp,zero1,zero1_allreduce --skip-memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.core import pairs
from dtlab.models import ModuleClassPolicy, get_model_strategy
from dtlab.optimizers import default_optimizer_strategy

DTLAB = pairs.DATA_PARALLEL
#: variants run only when named in --strategies: ZeRO-1 with DDP's all-reduce instead of reduce-scatter
DTLAB_EXTRA = {"zero1_allreduce": ("zero1", {"gradient_sync": "all_reduce"})}
TORCH = ("torch_ddp", "torch_fsdp2")


# ---------------------------------------------------------------------------- models
def make_mlp() -> nn.Module:
    """1024 -> 2048 -> 2048 -> 1024 -> 1024: 9.45M parameters."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
        nn.Linear(2048, 1024), nn.GELU(), nn.Linear(1024, 1024),
    )  # fmt: skip


class TinyGPT(nn.Module):
    """Decoder-only transformer: 4 pre-norm layers of width 256, 4 heads, vocabulary 4096 (5.3M params)."""

    def __init__(
        self, vocab: int = 4096, dim: int = 256, layers: int = 4, heads: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return cast(torch.Tensor, self.head(self.norm(h)))


def build(model: str) -> tuple[nn.Module, type[nn.Module], Any]:
    """The module (same values on every rank), its FSDP unit class and a batch maker."""
    torch.manual_seed(0)
    if model == "mlp":

        def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(1000 * rank + step)
            return torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)

        return make_mlp(), nn.Linear, mlp_batch

    def gpt_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, 4096, (8, 65), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return TinyGPT(), nn.TransformerEncoderLayer, gpt_batch


def loss_fn(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model == "mlp":
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# ---------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _tensor_bytes(ts: Any) -> int:
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


# ---------------------------------------------------------------------------- one configuration
class Run:
    """One strategy on one model in this process: built, warmed up, then timed in rounds."""

    def __init__(self, backend: CommunicationBackend, model: str, strategy: str) -> None:
        self.backend, self.model_name, self.strategy = backend, model, strategy
        self.rss_before = _status_kib("VmRSS")
        _reset_peak()
        module, unit_cls, self.batch = build(model)
        self.dist_opt: Any = None
        if strategy == "torch_ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model: nn.Module = DistributedDataParallel(module)
            self.opt: Any = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        elif strategy == "torch_fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (backend.world_size,))
            for sub in module.modules():
                if isinstance(sub, unit_cls):
                    fully_shard(sub, mesh=mesh)
            self.model = cast(nn.Module, fully_shard(module, mesh=mesh))
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        else:
            base, extra = DTLAB_EXTRA.get(strategy, (strategy, {}))
            kw: dict[str, Any] = dict(extra)
            if strategy == "fsdp":
                kw["wrap_policy"] = ModuleClassPolicy((unit_cls,))
            self.model = get_model_strategy(base)(module, backend, **kw)
            self.dist_opt = default_optimizer_strategy(base)(self.model, torch.optim.AdamW, lr=1e-4)
            self.opt = self.dist_opt
        self.times: list[float] = []
        self.bytes_per_step = 0.0
        self.step_no = 0
        self.peak_state = 0
        self.peak_gathered = 0  # FSDP2 only, measured by watch_gathered()

    def step(self, probe: bool = False) -> None:
        """One step; ``probe``: read the model state at the two moments every row is measured at
        (after backward, and after the optimizer step, both before ``zero_grad``) and keep the peak."""
        x, y = self.batch(self.backend.rank, self.step_no)
        self.step_no += 1
        loss = loss_fn(self.model_name, self.model(x), y)
        loss.backward()
        if probe:
            self.peak_state = max(self.peak_state, self.state_now())
        self.opt.step()
        if probe:
            self.peak_state = max(self.peak_state, self.state_now())
        self.opt.zero_grad()

    def timed(self, steps: int) -> None:
        self.backend.barrier()
        sent0 = self.backend.stats.bytes_sent
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.backend.barrier()
        self.times.append((time.perf_counter() - t0) / steps)
        sent = self.backend.stats.bytes_sent - sent0
        self.bytes_per_step = sent / steps  # barrier bytes are 0

    def state_now(self) -> int:
        """Parameters + gradients + optimizer state held now (+ the peak of gathered parameters for
        ZeRO-3, FSDP and FSDP2, which exist only inside forward and backward)."""
        if self.dist_opt is not None:
            rep = self.dist_opt.memory_report()
            state = rep["parameters"] + rep["gradients"] + rep["optimizer_state"]
            return int(state + (rep["peak_gathered_parameters"] if self.strategy in ("zero3", "fsdp") else 0))
        params = list(self.model.parameters())
        state = _tensor_bytes(params) + _tensor_bytes(p.grad for p in params)
        state += _tensor_bytes(v for s in self.opt.state.values() for v in s.values())
        if self.strategy == "torch_ddp":  # gradient buckets (gradient_as_bucket_view=False)
            state += _tensor_bytes(p for p in params if p.requires_grad)
        if self.strategy == "torch_fsdp2":  # the most unsharded parameters held at once (watch_gathered)
            state += self.peak_gathered
        return state

    def watch_gathered(self) -> None:
        """FSDP2: measure the peak of unsharded parameters during forward and backward: at every
        module's forward (pre and post) and backward (pre and post) hook, the bytes of the plain
        (not sharded) parameters the modules hold; all-gather buffers not yet swapped in (a prefetched
        unit) are not seen. Only for the memory probe: the hooks cost time."""
        from torch.distributed.tensor import DTensor

        def probe(*_: Any) -> None:
            seen: set[int] = set()
            total = 0
            for m in self.model.modules():
                for q in m.parameters(recurse=False):  # what each module holds right now
                    if isinstance(q, DTensor):
                        continue
                    st = q.untyped_storage()
                    if st.nbytes() and st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
            self.peak_gathered = max(self.peak_gathered, total)

        for m in self.model.modules():
            m.register_forward_pre_hook(probe)
            m.register_forward_hook(probe)
            m.register_full_backward_pre_hook(probe)
            m.register_full_backward_hook(probe)

    def memory(self) -> dict[str, int]:
        """The peak model state over the probed steps and the peak RSS this configuration added."""
        return {"model_state": self.peak_state, "peak_rss_delta": self._rss_delta()}

    def _rss_delta(self) -> int:
        return max(0, _status_kib("VmHWM") - self.rss_before) * 1024


def probe_memory(backend: CommunicationBackend, model: str, strategy: str) -> dict[str, int]:
    """In a fresh world: build one configuration, run 3 steps, report its memory (peak RSS is only
    meaningful in a process that has not allocated and freed model-sized memory before)."""
    torch.set_num_threads(1)
    run = Run(backend, model, strategy)
    if strategy == "torch_fsdp2":
        run.watch_gathered()
    for _ in range(3):
        run.step(probe=True)
    return run.memory()


def suite(
    backend: CommunicationBackend,
    engine: str,
    models: list[str],
    steps: int,
    warmup: int,
    rounds: int,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Runs in every process of the world; returns this rank's rows."""
    torch.set_num_threads(1)
    strategies = list(DTLAB) + (list(TORCH) if engine == "gloo" else [])
    strategies = [s for s in strategies if only is None or s in only]
    strategies += [s for s in DTLAB_EXTRA if only is not None and s in only]
    rows = []
    for model in models:
        runs: dict[str, Run] = {}
        for s in strategies:
            run = Run(backend, model, s)
            for _ in range(warmup):
                run.step()
            runs[s] = run
        for _ in range(rounds):
            for s in strategies:
                runs[s].timed(steps)
        for s in strategies:
            times = torch.tensor([statistics.median(runs[s].times)], dtype=torch.float64)
            backend.all_reduce(times, ReduceOp.MAX)  # a step ends when the slowest rank ends it
            nparams = sum(p.numel() for p in build(model)[0].parameters())
            rows.append(
                {
                    "engine": engine,
                    "model": model,
                    "params": nparams,
                    "strategy": s,
                    "step_ms": float(times[0]) * 1e3,
                    "bytes_per_step": runs[s].bytes_per_step if s not in TORCH else None,
                    "grad_bytes": 4 * nparams,
                }
            )
        del runs
    return rows


# ---------------------------------------------------------------------------- report
def _fmt_mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| engine | model | strategy | step (ms) | sent/rank/step (MiB) | sent / grad bytes "
        "| model state/rank, peak in step (MiB) | peak RSS added/rank (MiB) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "n/a" if r["bytes_per_step"] is None else f"{r['bytes_per_step'] / r['grad_bytes']:.2f}"
        name = r["strategy"] if r["strategy"] in TORCH else f"dtlab {r['strategy']}"
        out.append(
            f"| {r['engine']} | {r['model']} ({r['params'] / 1e6:.2f}M) | {name} | {r['step_ms']:.1f} | "
            f"{_fmt_mb(r['bytes_per_step'])} | {ratio} | {_fmt_mb(r['model_state'])} | "
            f"{_fmt_mb(r['peak_rss_delta'])} |"
        )
    out += ["", *MEMORY_NOTES]
    return "\n".join(out)


#: how the memory columns are measured (printed under the table)
MEMORY_NOTES = [
    "- model state/rank, peak in step: parameters + gradients + optimizer state, read for every row at the "
    "same two moments of a step (after backward, and after the optimizer step, both before zero_grad; "
    "the larger), plus the step's peak of gathered parameters for ZeRO-3, FSDP and FSDP2 (they exist only "
    "inside forward/backward; measured: dtlab's counter at every gather, FSDP2's unsharded parameters at "
    "every module's forward and backward hooks, a prefetched unit not yet swapped in unseen); torch DDP "
    "counts its gradient buckets",
    "- peak RSS added/rank: the process's peak resident memory (VmHWM) over its RSS before building, in a "
    "fresh world per row, over the build and 3 steps",
]


def ratios(rows: list[dict[str, Any]]) -> str:
    def t(engine: str, model: str, strategy: str) -> float | None:
        for r in rows:
            if (r["engine"], r["model"], r["strategy"]) == (engine, model, strategy):
                return float(r["step_ms"])
        return None

    lines = []
    for model in sorted({r["model"] for r in rows}):
        checks = [
            (
                "dtlab DDP (gloo) / torch DDP (gloo)",
                t("gloo", model, "ddp"),
                t("gloo", model, "torch_ddp"),
                1.05,
            ),
            (
                "dtlab FSDP (gloo) / torch FSDP2 (gloo)",
                t("gloo", model, "fsdp"),
                t("gloo", model, "torch_fsdp2"),
                1.0,
            ),
            (
                "dtlab DDP (MPI) / torch DDP (gloo)",
                t("mpi", model, "ddp"),
                t("gloo", model, "torch_ddp"),
                1.0,
            ),
        ]
        for label, a, b, goal in checks:
            if a is not None and b is not None:
                verdict = "met" if a / b <= goal else "NOT met"
                lines.append(f"- {model}: {label} = {a / b:.3f} (goal <= {goal}: {verdict})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="gloo,mpi", help="comma-separated: gloo, mpi")
    ap.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp, transformer")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (median reported)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--strategies", default=None, help="comma-separated subset, e.g. ddp,torch_ddp")
    ap.add_argument("--skip-memory", action="store_true", help="no per-configuration memory probes")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    from dtlab.testing import spawn_world

    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in ("mlp", "transformer")]
    if bad:
        ap.error(f"unknown models {bad}; choose from mlp, transformer")
    known = [*DTLAB, *DTLAB_EXTRA, *TORCH]
    unknown = [s for s in (args.strategies or "").split(",") if s and s not in known]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {', '.join(known)}")
    rows: list[dict[str, Any]] = []
    for engine in [e for e in args.engines.split(",") if e]:
        if engine not in ("gloo", "mpi"):
            ap.error(f"unknown engine {engine!r}; choose gloo or mpi")
        result = spawn_world(
            args.world_size,
            suite,
            engine,
            models,
            args.steps,
            args.warmup,
            args.rounds,
            args.strategies.split(",") if args.strategies else None,
            backend=engine,
            timeout=3000,
            check_collectives=False,
        )
        for row in result[0]:
            if args.skip_memory:
                row["model_state"] = row["peak_rss_delta"] = None
                rows.append(row)
                continue
            mem = spawn_world(
                args.world_size,
                probe_memory,
                row["model"],
                row["strategy"],
                backend=engine,
                timeout=600,
                check_collectives=False,
            )
            row["model_state"] = max(m["model_state"] for m in mem)
            row["peak_rss_delta"] = max(m["peak_rss_delta"] for m in mem)
            rows.append(row)
        print(f"[{engine} done]", file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print(ratios(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
