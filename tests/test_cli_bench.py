"""`dtlab bench` report writing: PNG plots from rows in the benchmarks' JSON format (the benchmarks
themselves take minutes and are run by hand: `dtlab bench`; tests/test_installed.py runs them at a
toy size from an installed wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import MappingProxyType

import pytest

from dtlab.benchmarks import bench
from dtlab.errors import DtlabError

# rows as dtlab.benchmarks.strategies and dtlab.benchmarks.compression write them (values from a real run)
STRATEGY_ROWS = [
    {"engine": "gloo", "model": "mlp", "params": 9443328, "strategy": s, "step_ms": ms,
     "bytes_per_step": b, "grad_bytes": 37773312, "model_state": m, "peak_rss_delta": 1 << 27}
    for s, ms, b, m in [("ddp", 197.1, 37773312.0, 151093280), ("fsdp", 305.5, 56659968.0, 100728848),
                        ("torch_ddp", 196.2, None, 113319968)]
]  # fmt: skip
COMPRESSION_ROWS = [
    {"rate": "plain", "engine": "mpi", "P": 2, "algorithm": a, "seconds": sec, "first_seconds": sec,
     "bytes_sent": b, "rank0_bytes_sent": b, "formula_bytes": b, "formula": "f", "selected": 1.0,
     "local_selected": 1.0, "select_seconds": 0.0}
    for a, sec, b in [("dense", 0.013, 8000000), ("oktopk", 0.163, 260000)]
]  # fmt: skip

# rows as dtlab.benchmarks.mesh writes them (the keys the plot reads)
MESH_ROWS = [
    {"engine": e, "mesh": m, "strategy": s, "step_ms": ms, "state": st}
    for e, m, s, ms, st in [("inmemory", "pp1 dp8 tp1", "ddp", 228.0, 3750000),
                            ("inmemory", "pp2 dp2 tp2", "fsdp", 601.0, 482000),
                            ("gloo", "pp2 dp1 tp2", "ddp", 90.0, 965000)]
]  # fmt: skip


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bench._plot_strategies(STRATEGY_ROWS, tmp_path / "s.png")
    bench._plot_compression(COMPRESSION_ROWS, tmp_path / "c.png")
    bench._plot_mesh(MESH_ROWS, tmp_path / "m.png")
    for name in ("s.png", "c.png", "m.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_benchmarks_run_as_modules_of_the_package_with_the_engines_found() -> None:
    cmd = bench._command("strategies", ["gloo"], full=False)
    assert cmd[1:3] == ["-m", "dtlab.benchmarks.strategies"] and cmd[-2:] == ["--engines", "gloo"]
    cmd = bench._command("compression", ["gloo", "mpi"], full=True)
    assert cmd[1:] == ["-m", "dtlab.benchmarks.compression", "--engines", "gloo", "mpi"]
    cmd = bench._command("mesh", ["gloo", "mpi"], full=True)
    assert cmd[1:] == ["-m", "dtlab.benchmarks.mesh", "--engines", "inmemory,gloo,mpi"]
    assert bench.mpi_available() == (importlib.util.find_spec("mpi4py") is not None)  # the dev venv has mpich


def test_missing_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    with pytest.raises(DtlabError, match=r"dtlab\[bench\]"):
        bench.run_bench(tmp_path / "out")


FAKE_BENCH = """
import json, sys, time
args = sys.argv[1:]
out = args[args.index("--json") + 1]
mode = {mode!r}
if mode == "hang":
    time.sleep(600)
if mode == "fail":
    print("fake failure", flush=True)
    sys.exit(3)
print("| strategy | step ms |")
print("| ddp | 1.0 |")
json.dump({rows!r}, open(out, "w"))
"""


def _fake_benchmarks(monkeypatch: pytest.MonkeyPatch, root: Path, strategies: str, compression: str) -> None:
    """Modules fake_strategies / fake_compression / fake_mesh on PYTHONPATH, run with the real quick
    arguments."""
    root.mkdir()
    (root / "fake_strategies.py").write_text(FAKE_BENCH.format(mode=strategies, rows=STRATEGY_ROWS))
    (root / "fake_compression.py").write_text(FAKE_BENCH.format(mode=compression, rows=COMPRESSION_ROWS))
    (root / "fake_mesh.py").write_text(FAKE_BENCH.format(mode="ok", rows=MESH_ROWS))
    monkeypatch.setenv("PYTHONPATH", str(root))
    fake = {name: (f"fake_{name}", quick) for name, (_, quick) in bench.BENCHMARKS.items()}
    monkeypatch.setattr(bench, "BENCHMARKS", MappingProxyType(fake))


def test_run_bench_writes_table_rows_and_plots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _fake_benchmarks(monkeypatch, tmp_path / "benchmarks", "ok", "ok")
    out = tmp_path / "out"
    assert bench.run_bench(out, timeout=60) == 0
    report = (out / "bench.md").read_text()
    assert "## strategies" in report and "## compression" in report and "## mesh" in report
    assert "| ddp | 1.0 |" in report and "![strategies](strategies.png)" in report
    assert "--numel 2000000" in report  # the quick sizes were passed on
    for name in ("strategies", "compression", "mesh"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / f"{name}.json").is_file() and (out / f"{name}.log").is_file()


def test_run_bench_reports_a_failed_and_a_hung_benchmark(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_benchmarks(monkeypatch, tmp_path / "benchmarks", "fail", "hang")
    out = tmp_path / "out"
    assert bench.run_bench(out, timeout=3) == 1  # the hung one is killed (its process group) after 3 s
    report = (out / "bench.md").read_text()
    assert report.count("FAILED") == 2 and "fake failure" in report and "exit 3" in report
    assert "killed after 3 s" in (out / "compression.log").read_text()
