"""`benchmarks/convergence.py` end to end at a toy size: it runs, every row is finite and its byte
counts add up (the real runs take minutes and are run by hand; their results are in
docs/compression.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_convergence_benchmark_runs_at_toy_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--task", "lm", "--world", "2",
        "--epochs", "2", "--corpus-bytes", "20000", "--hidden", "16", "--warmup", "3",
        "--algorithms", "topka", "oktopk", "--densities", "0.05", "--out-dir", str(tmp_path),
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["algorithm"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense", "topka", "oktopk"}
    steps = 2 * ((281 - 32) // 32 + 1)  # 20000 bytes -> 312 windows of 64, 90% train, global batch 32
    for name, row in rows.items():
        assert row["final"] is not None and 1.0 < row["final"] < 300.0, (name, row)
        # the 3 warm-up steps send the dense gradient (plus a few bytes of metadata), the rest
        # average mean_bytes_sent
        expected = 3 * rows["dense"]["mean_bytes_sent"] + (steps - 3) * row["mean_bytes_sent"]
        assert row["total_bytes_sent"] == pytest.approx(expected, rel=1e-3), name
    assert rows["oktopk"]["mean_bytes_sent"] < rows["dense"]["mean_bytes_sent"] / 3
    assert 0.02 < rows["oktopk"]["mean_selected_density"] < 0.1
    assert (tmp_path / "compression_lm_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "| lm | oktopk | 0.05 |" in proc.stdout
