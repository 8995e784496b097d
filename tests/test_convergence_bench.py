"""`python -m dtlab.benchmarks.convergence` end to end at a toy size: it runs, every row is finite and
its byte counts add up (the real runs take minutes and are run by hand; their results are in
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
        sys.executable, "-m", "dtlab.benchmarks.convergence", "--task", "lm", "--world", "2",
        "--epochs", "2", "--corpus-bytes", "20000", "--hidden", "16", "--warmup", "3",
        "--algorithms", "topka", "oktopk", "--densities", "0.05", "--out-dir", str(tmp_path),
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["algorithm"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense", "topka", "oktopk"}
    steps = 2 * ((249 - 32) // 32 + 1)  # 20000 bytes -> 312 windows of 64, 80% train, global batch 32
    for name, row in rows.items():
        assert row["final"] is not None and 1.0 < row["final"] < 300.0, (name, row)
        assert row["val"] is not None and 1.0 < row["val"] < 300.0, (name, row)
        assert row["val"] != row["final"]  # two splits, two figures
        # the 3 warm-up steps send the dense gradient (plus a few bytes of metadata), the rest
        # average mean_bytes_sent
        expected = 3 * rows["dense"]["mean_bytes_sent"] + (steps - 3) * row["mean_bytes_sent"]
        assert row["total_bytes_sent"] == pytest.approx(expected, rel=1e-3), name
    assert rows["oktopk"]["mean_bytes_sent"] < rows["dense"]["mean_bytes_sent"] / 3
    assert 0.02 < rows["oktopk"]["mean_selected_density"] < 0.1
    assert (tmp_path / "compression_lm_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "| lm | oktopk | 0.05 |" in proc.stdout


def _row(alg: str, lr: float, recipe: str, val: float, test: float, sent: int) -> dict[str, object]:
    return {
        "algorithm": alg, "density": 1.0 if alg == "dense" else 0.01, "recipe_name": recipe,
        "recipe": {"lr": lr}, "val": val, "final": test, "total_bytes_sent": sent,
    }  # fmt: skip


def test_protocol_chooses_on_validation_only() -> None:
    """The learning rate of the best dense validation figure; then the cheapest recipe within 3% on
    validation; the test figures (``final``) never move the choice."""
    from dtlab.benchmarks.convergence_protocol import choose_from, row

    rows = [
        _row("dense", 0.5, "dense", 2.50, 1.0, 100),
        _row("dense", 1.0, "dense", 2.40, 9.0, 100),  # the best on validation (worst on test)
        _row("topka", 1.0, "long", 2.42, 1.0, 30),
        _row("oktopk", 1.0, "long", 2.45, 1.0, 30),
        _row("topka", 1.0, "short", 2.44, 9.0, 10),
        _row("oktopk", 1.0, "short", 2.46, 9.0, 10),  # +2.5 %: within 3 %, fewer bytes
        _row("topka", 1.0, "cheapest", 2.60, 1.0, 1),  # +8.3 %: out
        _row("oktopk", 1.0, "cheapest", 2.41, 1.0, 1),
        _row("topka", 0.5, "short", 2.50, 1.0, 1),  # the other learning rate: not considered
    ]
    chosen = choose_from("lm", rows)
    assert chosen["lr"] == 1.0
    assert chosen["chosen"]["name"] == "short"
    assert chosen["chosen"]["worst_val_gap"] == pytest.approx(2.5)
    # none within the target: the smallest worst gap
    far = [r for r in rows if r["recipe_name"] in ("dense", "cheapest")]
    assert choose_from("lm", far)["chosen"]["name"] == "cheapest"
    # digits: accuracy, higher is better; a diverged run (None) is never within the target
    digits = [
        _row("dense", 0.05, "dense", 98.0, 0, 100),
        _row("topka", 0.05, "a", 97.5, 0, 10),
        _row("topka", 0.05, "b", None, 0, 1),  # type: ignore[arg-type]
    ]
    assert choose_from("digits", digits)["chosen"]["name"] == "a"
    # equal worst gaps: the smaller mean gap wins, then the fewer bytes
    tied = [
        _row("dense", 0.05, "dense", 98.0, 0, 100),
        *(_row(a, 0.05, "c", v, 0, 5) for a, v in (("topka", 96.0), ("oktopk", 96.0))),
        *(_row(a, 0.05, "d", v, 0, 50) for a, v in (("topka", 96.0), ("oktopk", 99.0))),
    ]
    assert choose_from("digits", tied)["chosen"]["name"] == "d"
    line = row(
        "lm", "topka", 0.01, [([_row("topka", 1, "x", 0, 2.5, 10)], _row("dense", 1, "d", 0, 2.0, 100))]
    )
    assert line == "| topka | 1% | 2.500 (+25.00%) | +25.00% | +25.00% | 10.0 % |"
