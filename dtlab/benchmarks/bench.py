"""``dtlab bench``: run the strategy, compression and mesh benchmarks as subprocesses, then write one
markdown table and PNG plots from the rows they produce (``--json``).

The benchmarks ship with the package (``dtlab.benchmarks.strategies`` and
``dtlab.benchmarks.compression``; ``pip install dtlab[bench]`` adds matplotlib for the plots and
scikit-learn for the digits task). They run on Gloo, and on MPI too where mpi4py and ``mpiexec`` are
installed (``pip install dtlab[mpi] mpich``). By default they run with small sizes (a few minutes on 2
CPU cores); ``full=True`` uses their own defaults. Each runs in its own process group, killed whole on
timeout.

A signal (SIGINT, SIGTERM, SIGHUP) to ``dtlab bench`` ends the running benchmark's whole process group
(SIGTERM, then SIGKILL after 5 s: the benchmark, its launcher and every rank), runs nothing more, and
writes ``bench.md`` with the tables of the benchmarks that finished and a line for the stopped one;
the exit status is 128 + the signal's number.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


class _Stopped(Exception):
    """A signal reached ``dtlab bench`` (raised by its handler, once)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        #: the stopped benchmark's section of ``bench.md``
        self.section: list[str] = []


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """The first SIGINT/SIGTERM/SIGHUP raises :class:`_Stopped` in the main thread; later ones are
    ignored while the benchmark's processes are ended and the report is written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.getsignal(s) for s in signals}
    seen: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if not seen:
            seen.append(signum)
            raise _Stopped(signum)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc``'s process group: SIGTERM (launchers pass it on to their ranks), SIGKILL after 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group, the benchmark's ranks too
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    # the benchmark imports the same dtlab as this process, installed or from a checkout
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the benchmark and every rank it started
            proc.wait(timeout=30)
            out.write(f"\n[dtlab bench] killed after {timeout:.0f} s\n")
            return -9
        except _Stopped as exc:
            _end_group(proc)
            out.write(f"\n[dtlab bench] stopped by {exc}: the benchmark and its processes were ended\n")
            raise
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks the benchmark left behind, if any
        except ProcessLookupError:
            pass
        return code


#: one panel of a figure: its title, the categories along x, per group its label and value per category
#: (bars side by side, a missing value drawn as 0), and whether the y axis is logarithmic
Panel = tuple[str, list[str], list[tuple[str, dict[str, float]]], bool]


def _draw(panels: list[list[Panel]], figsize: tuple[float, float], path: Path) -> None:
    """One row of axes per row of ``panels``, grouped bars in each, written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), len(panels[0]), figsize=figsize, squeeze=False)
    for row, ax_row in zip(panels, axes, strict=True):
        for (title, categories, groups, log), ax in zip(row, ax_row, strict=True):
            width = 0.8 / max(1, len(groups))
            for gi, (label, values) in enumerate(groups):
                xs = [i + gi * width for i in range(len(categories))]
                ax.bar(xs, [values.get(c, 0) for c in categories], width, label=label)
            ax.set_xticks(
                [i + width * (len(groups) - 1) / 2 for i in range(len(categories))], categories, rotation=30
            )
            if log:
                ax.set_yscale("log")
            ax.set_title(title)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_strategies(rows: list[dict[str, Any]], path: Path) -> None:
    groups = sorted({(r["engine"], r["model"]) for r in rows})
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    step: list[tuple[str, dict[str, float]]] = []
    memory: list[tuple[str, dict[str, float]]] = []
    for engine, model in groups:
        sel = {r["strategy"]: r for r in rows if (r["engine"], r["model"]) == (engine, model)}
        step.append((f"{engine} {model}", {s: r["step_ms"] for s, r in sel.items()}))
        memory.append((f"{engine} {model}", {s: r.get("model_state", 0) / 2**20 for s, r in sel.items()}))
    panels: list[Panel] = [
        ("step time (ms, median)", strategies, step, False),
        ("model state per rank, peak in step (MiB)", strategies, memory, False),
    ]
    _draw([panels], (12, 4.5), path)


def _plot_compression(rows: list[dict[str, Any]], path: Path) -> None:
    def where(r: dict[str, Any]) -> tuple[str, str, int, str]:
        return r["rate"], r["engine"], r["P"], r.get("semantics", "all_reduce")

    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    time_ms: list[tuple[str, dict[str, float]]] = []
    sent: list[tuple[str, dict[str, float]]] = []
    for key in sorted({where(r) for r in rows}):
        sel = {r["algorithm"]: r for r in rows if where(r) == key}
        # reduce-scatter: Ok-Topk's reduced form (no boundary balancing, no global selection)
        label = f"{key[0]} {key[1]} P={key[2]}" + (" reduce-scatter" if key[3] == "reduce_scatter" else "")
        time_ms.append((label, {a: r.get("amortised_seconds", r["seconds"]) * 1e3 for a, r in sel.items()}))
        sent.append((label, {a: r["rank0_bytes_sent"] / 1e6 for a, r in sel.items()}))
    panels: list[Panel] = [
        ("ms per iteration", algos, time_ms, True),
        ("MB sent by rank 0 per iteration", algos, sent, True),
    ]
    _draw([panels], (12, 4.5), path)


def _plot_mesh(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time and state memory per rank for every mesh shape, one bar per strategy, per engine."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    figure: list[list[Panel]] = []
    for engine in engines:
        mine = [r for r in rows if r["engine"] == engine]
        meshes = list(dict.fromkeys(r["mesh"] for r in mine))
        step: list[tuple[str, dict[str, float]]] = []
        state: list[tuple[str, dict[str, float]]] = []
        for strategy in strategies:
            sel = {r["mesh"]: r for r in mine if r["strategy"] == strategy}
            step.append((strategy, {m: r["step_ms"] for m, r in sel.items()}))
            state.append((strategy, {m: r["state"] / 2**20 for m, r in sel.items()}))
        figure.append(
            [
                (f"{engine}: step time (ms)", meshes, step, False),
                (f"{engine}: state per rank (MiB)", meshes, state, False),
            ]
        )
    _draw(figure, (13, 4.2 * len(engines)), path)


def _one(name: str, engines: list[str], full: bool, out: Path, timeout: float) -> tuple[list[str], bool]:
    """Run benchmark ``name``; its section of ``bench.md`` and whether it failed."""
    rows_path, log = out / f"{name}.json", out / f"{name}.log"
    rows_path.unlink(missing_ok=True)
    cmd = [*_command(name, engines, full), "--json", str(rows_path)]
    print(f"[dtlab bench] {name}: python {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        code = _run(cmd, log, timeout)
    except _Stopped as exc:
        dt = time.perf_counter() - t0
        exc.section = [f"## {name}", "", f"STOPPED by {exc} after {dt:.0f} s (partial log: `{log}`)", ""]
        raise
    dt = time.perf_counter() - t0
    report = [f"## {name}", "", f"Command: `python {' '.join(cmd[1:-2])}` ({dt:.0f} s, exit {code})", ""]
    if code != 0 or not rows_path.exists():
        return [
            *report,
            f"FAILED, see `{log}`:",
            "",
            "```",
            *log.read_text().splitlines()[-15:],
            "```",
            "",
        ], True
    rows = json.loads(rows_path.read_text())
    text = log.read_text()
    table = [line for line in text.splitlines() if line.startswith("|") or line.startswith("- ")]
    report += [*table, ""]
    plot = out / f"{name}.png"
    {"strategies": _plot_strategies, "compression": _plot_compression, "mesh": _plot_mesh}[name](rows, plot)
    return [*report, f"![{name}]({plot.name})", ""], False


def run_bench(
    out_dir: str | Path, only: str | None = None, full: bool = False, timeout: float = 900.0
) -> int:
    """Run the benchmarks; write ``bench.md``, ``<name>.json``, ``<name>.log`` and ``<name>.png``.
    On a signal: the running benchmark's processes ended, ``bench.md`` of what finished, 128 + n."""
    _check_plotting()
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DtlabError(
            f"--out {out} cannot be created: {exc.strerror or exc}; choose a directory this user can write"
        ) from None
    names = [only] if only else list(BENCHMARKS)
    engines = ["gloo", "mpi"] if mpi_available() else ["gloo"]
    report = ["# dtlab bench", ""]
    if "mpi" not in engines:
        note = "MPI skipped: mpi4py or mpiexec is not installed (pip install 'dtlab[mpi]' mpich)"
        print(f"[dtlab bench] {note}", file=sys.stderr, flush=True)
        report += [note, ""]
    failed: list[str] = []
    stopped: _Stopped | None = None
    with _stop_on_signals():
        for name in names:
            if stopped is not None:
                report += [f"## {name}", "", f"not run: dtlab bench was stopped by {stopped}", ""]
                continue
            try:
                section, bad = _one(name, engines, full, out, timeout)
            except _Stopped as exc:
                stopped = exc
                section, bad = exc.section or [f"## {name}", "", f"STOPPED by {exc}", ""], True
                print(f"[dtlab bench] {name}: stopped by {exc}; its processes were ended", file=sys.stderr)
            report += section
            if bad and stopped is None:
                failed.append(name)
        (out / "bench.md").write_text("\n".join(report))
    print("\n".join(report))
    print(f"[dtlab bench] wrote {out / 'bench.md'}", file=sys.stderr)
    if stopped is not None:
        return 128 + stopped.signum
    if failed:
        print(f"[dtlab bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
