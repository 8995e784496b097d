"""``dtlab bench``: run the strategy, compression and mesh benchmarks as subprocesses, then write one
markdown table and PNG plots from the rows they produce (``--json``).

The benchmarks ship with the package (``dtlab.benchmarks.strategies`` and
``dtlab.benchmarks.compression``; ``pip install dtlab[bench]`` adds matplotlib for the plots and
scikit-learn for the digits task). They run on Gloo, and on MPI too where mpi4py and ``mpiexec`` are
installed (``pip install dtlab[mpi] mpich``). By default they run with small sizes (a few minutes on 2
CPU cores); ``full=True`` uses their own defaults. Each runs in its own process group, killed whole on
timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dtlab.errors import DtlabError

__all__ = ["BENCHMARKS", "mpi_available", "run_bench"]

#: name -> (module, arguments for the quick default run); ``--engines`` is added per machine
BENCHMARKS: MappingProxyType[str, tuple[str, tuple[str, ...]]] = MappingProxyType(
    {
        "strategies": (
            "dtlab.benchmarks.strategies",
            ("--models", "mlp", "--steps", "2", "--warmup", "1", "--rounds", "2"),
        ),
        "compression": (
            "dtlab.benchmarks.compression",
            ("--numel", "2000000", "--worlds", "2", "--rates", "plain", "--iters", "3"),
        ),
        "mesh": (
            "dtlab.benchmarks.mesh",
            ("--strategies", "ddp,zero2,fsdp", "--steps", "2", "--warmup", "1"),
        ),
    }
)


def mpi_available() -> bool:
    """mpi4py importable and an ``mpiexec`` next to this Python or on ``PATH``."""
    if importlib.util.find_spec("mpi4py") is None:
        return False
    from dtlab.testing.spawn import find_mpiexec

    try:
        find_mpiexec()
    except DtlabError:
        return False
    return True


def _command(name: str, engines: list[str], full: bool) -> list[str]:
    module, quick = BENCHMARKS[name]
    # strategies takes "gloo,mpi", compression "gloo mpi", mesh "inmemory,gloo,mpi" (8 threads, 4 processes)
    if name == "mesh":
        eng = [",".join(["inmemory", *engines])]
    else:
        eng = [",".join(engines)] if name == "strategies" else engines
    return [sys.executable, "-m", module, *(() if full else quick), "--engines", *eng]


def _check_plotting() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise DtlabError("dtlab bench draws its plots with matplotlib: pip install 'dtlab[bench]'")


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    # the benchmark imports the same dtlab as this process, installed or from a checkout
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the benchmark and every rank it started
            proc.wait(timeout=30)
            out.write(f"\n[dtlab bench] killed after {timeout:.0f} s\n")
            return -9


def _plot_strategies(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["engine"], r["model"]) for r in rows})
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(groups))
    for gi, (engine, model) in enumerate(groups):
        sel = {r["strategy"]: r for r in rows if (r["engine"], r["model"]) == (engine, model)}
        xs = [i + gi * width for i in range(len(strategies))]
        axes[0].bar(
            xs, [sel[s]["step_ms"] if s in sel else 0 for s in strategies], width, label=f"{engine} {model}"
        )
        mem = [sel[s].get("model_state", 0) / 2**20 if s in sel else 0 for s in strategies]
        axes[1].bar(xs, mem, width, label=f"{engine} {model}")
    for ax, title in zip(axes, ("step time (ms, median)", "model state per rank (MiB)"), strict=True):
        ax.set_xticks(
            [i + width * (len(groups) - 1) / 2 for i in range(len(strategies))], strategies, rotation=30
        )
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_compression(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def where(r: dict[str, Any]) -> tuple[str, str, int, str]:
        return r["rate"], r["engine"], r["P"], r.get("semantics", "all_reduce")

    groups = sorted({where(r) for r in rows})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(groups))
    for gi, key in enumerate(groups):
        sel = {r["algorithm"]: r for r in rows if where(r) == key}
        xs = [i + gi * width for i in range(len(algos))]
        secs = [sel[a].get("amortised_seconds", sel[a]["seconds"]) * 1e3 if a in sel else 0 for a in algos]
        # reduce-scatter: Ok-Topk's reduced form (no boundary balancing, no global selection)
        label = f"{key[0]} {key[1]} P={key[2]}" + (" reduce-scatter" if key[3] == "reduce_scatter" else "")
        axes[0].bar(xs, secs, width, label=label)
        sent = [sel[a]["rank0_bytes_sent"] / 1e6 if a in sel else 0 for a in algos]
        axes[1].bar(xs, sent, width, label=label)
    for ax, title in zip(axes, ("ms per iteration", "MB sent by rank 0 per iteration"), strict=True):
        ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(algos))], algos, rotation=30)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_mesh(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time and state memory per rank for every mesh shape, one bar per strategy, per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(r["engine"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(len(engines), 2, figsize=(13, 4.2 * len(engines)), squeeze=False)
    width = 0.8 / max(1, len(strategies))
    for ei, engine in enumerate(engines):
        mine = [r for r in rows if r["engine"] == engine]
        meshes = list(dict.fromkeys(r["mesh"] for r in mine))
        for si, strategy in enumerate(strategies):
            sel = {r["mesh"]: r for r in mine if r["strategy"] == strategy}
            xs = [i + si * width for i in range(len(meshes))]
            axes[ei][0].bar(xs, [sel[m]["step_ms"] if m in sel else 0 for m in meshes], width, label=strategy)
            mem = [sel[m]["state"] / 2**20 if m in sel else 0 for m in meshes]
            axes[ei][1].bar(xs, mem, width, label=strategy)
        for ax, title in zip(axes[ei], ("step time (ms)", "state per rank (MiB)"), strict=True):
            ax.set_xticks(
                [i + width * (len(strategies) - 1) / 2 for i in range(len(meshes))], meshes, rotation=30
            )
            ax.set_title(f"{engine}: {title}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(
    out_dir: str | Path, only: str | None = None, full: bool = False, timeout: float = 900.0
) -> int:
    """Run the benchmarks; write ``bench.md``, ``<name>.json``, ``<name>.log`` and ``<name>.png``."""
    _check_plotting()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [only] if only else list(BENCHMARKS)
    engines = ["gloo", "mpi"] if mpi_available() else ["gloo"]
    report = ["# dtlab bench", ""]
    if "mpi" not in engines:
        note = "MPI skipped: mpi4py or mpiexec is not installed (pip install 'dtlab[mpi]' mpich)"
        print(f"[dtlab bench] {note}", file=sys.stderr, flush=True)
        report += [note, ""]
    failed = []
    for name in names:
        rows_path, log = out / f"{name}.json", out / f"{name}.log"
        rows_path.unlink(missing_ok=True)
        cmd = [*_command(name, engines, full), "--json", str(rows_path)]
        print(f"[dtlab bench] {name}: python {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        code = _run(cmd, log, timeout)
        dt = time.perf_counter() - t0
        report += [f"## {name}", "", f"Command: `python {' '.join(cmd[1:-2])}` ({dt:.0f} s, exit {code})", ""]
        if code != 0 or not rows_path.exists():
            failed.append(name)
            report += [f"FAILED, see `{log}`:", "", "```", *log.read_text().splitlines()[-15:], "```", ""]
            continue
        rows = json.loads(rows_path.read_text())
        text = log.read_text()
        table = [line for line in text.splitlines() if line.startswith("|") or line.startswith("- ")]
        report += [*table, ""]
        plot = out / f"{name}.png"
        {"strategies": _plot_strategies, "compression": _plot_compression, "mesh": _plot_mesh}[name](
            rows, plot
        )
        report += [f"![{name}]({plot.name})", ""]
    (out / "bench.md").write_text("\n".join(report))
    print("\n".join(report))
    print(f"[dtlab bench] wrote {out / 'bench.md'}", file=sys.stderr)
    if failed:
        print(f"[dtlab bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
