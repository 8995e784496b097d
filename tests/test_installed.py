"""dtlab as a user gets it: a wheel built from the package files, installed into a fresh directory and
imported from a directory that is not the checkout; its benchmarks and the digits example run there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_wheel_installed_elsewhere_runs_the_benchmarks_and_the_digits_example(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    src, wheels, site, user = (tmp_path / d for d in ("src", "wheels", "site", "user"))
    src.mkdir()
    user.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "dtlab", src / "dtlab", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)],
        user,
        env,
    )
    (wheel,) = wheels.glob("dtlab-*.whl")
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], user, env)
    meta = next(site.glob("dtlab-*.dist-info")) / "METADATA"
    extras = [line for line in meta.read_text().splitlines() if 'extra == "bench"' in line]
    assert {e.split(";")[0].split(": ")[1] for e in extras} == {"matplotlib", "scikit-learn"}

    env["PYTHONPATH"] = str(site)  # the installed copy, not the checkout (the cwd is neither)
    # one interpreter: where the benchmarks are imported from, then ``python -m dtlab bench --help``
    # (runpy runs the wheel's dtlab/__main__.py as -m does)
    bench_help = "sys.argv = ['dtlab', 'bench', '--help']; runpy.run_module('dtlab', run_name='__main__')"
    code = f"import runpy, sys; import dtlab.benchmarks.strategies as m; print(m.__file__); {bench_help}"
    where, usage = _run([sys.executable, "-c", code], user, env).split("\n", 1)
    assert Path(where.strip()).is_relative_to(site), where
    assert usage.startswith("usage: dtlab bench"), usage[:300]

    rows_path = user / "compression.json"
    cmd = [sys.executable, "-m", "dtlab.benchmarks.compression", "--numel", "20000", "--worlds", "2"]
    cmd += ["--rates", "plain", "--engines", "gloo", "--iters", "1", "--algorithms", "dense", "oktopk"]
    out = _run([*cmd, "--json", str(rows_path)], user, env)
    rows = json.loads(rows_path.read_text())
    assert [r["algorithm"] for r in rows] == ["dense", "oktopk"]
    assert "| plain | gloo | 2 | all-reduce | oktopk |" in out
    assert rows[0]["bytes_sent"] > 10 * rows[1]["bytes_sent"] > 0

    shutil.copy(ROOT / "examples" / "train_oktopk.py", user)
    short = [
        "train.steps=6",
        "train.eval_every=6",
        "optimizer.warmup_steps=1",
        "compression.dense_warmup_steps=2",
        "logging.plot=false",  # no loss.png: matplotlib, seconds per run (tests/test_run_logging.py)
    ]
    out = _run([sys.executable, "train_oktopk.py", *short], user, env)
    dense, oktopk = (line.split() for line in out.splitlines()[1:3])
    assert dense[0] == "dense" and oktopk[0] == "Ok-Topk"
    assert float(oktopk[-1]) < float(dense[-1])  # MB sent per rank: the compressed run sends less
