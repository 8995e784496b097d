"""Progress and summary output: a live bar on a terminal, plain lines (no escape codes) anywhere else."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from dtlab.testing import TINY_LM
from dtlab.trainers.progress import ProgressBar
from dtlab.trainers.report import print_tables, profile_table, summary_table

ESC = "\x1b"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream: io.StringIO) -> str:
    bar = ProgressBar(10, stream=stream, plain_interval=0.0)
    bar.print_line("step     5 | loss 1.0000")
    for step in range(1, 11):
        bar.update(step, f"loss {1.0 / step:.4f}")
    bar.close()
    return stream.getvalue()


def test_plain_lines_off_a_terminal_and_a_live_bar_on_one() -> None:
    plain = _drive(io.StringIO())
    assert ESC not in plain and "\r" not in plain
    lines = plain.splitlines()
    assert lines[0] == "step     5 | loss 1.0000"
    assert lines[1].startswith("progress 1/10 (10%) | loss 1.0000 |") and "left" in lines[1]
    assert lines[-1].startswith("progress 10/10 (100%) | loss 0.1000 |") and "left" not in lines[-1]
    live = _drive(_Terminal())
    assert ESC in live and "10/10" in live and "step     5 | loss 1.0000" in live


def test_plain_lines_are_rate_limited_and_a_resumed_run_starts_where_it_stopped() -> None:
    out = io.StringIO()
    bar = ProgressBar(100, stream=out, initial=40, plain_interval=3600.0)
    for step in range(41, 101):
        bar.update(step)
    bar.close()
    lines = out.getvalue().splitlines()  # only the last step's line: the interval never passed
    assert len(lines) == 1 and lines[0].startswith("progress 100/100 (100%) |")
    quiet = _Terminal()
    off = ProgressBar(5, enabled=False, stream=quiet)
    off.update(5)
    off.print_line("x")
    off.close()
    assert quiet.getvalue() == ""


def test_summary_and_profile_tables_are_plain_text_off_a_terminal() -> None:
    out = io.StringIO()
    profile = {
        "wall_seconds": 2.0,
        "phases": {
            "compute/forward_backward": {"seconds": 1.5, "fraction": 0.75},
            "comm/all_reduce": {"seconds": 0.5, "fraction": 0.25},
        },
    }
    rows = {"task": "t", "samples/s": 1234.5, "eval loss (last)": None, "loss": 0.123456}
    print_tables(summary_table(rows, title="dtlab train: summary"), profile_table(profile), file=out)
    text = out.getvalue()
    assert ESC not in text and "dtlab train: summary" in text
    assert "1,234" in text and "0.1235" in text and "eval loss" not in text  # None rows are left out
    fb = next(line for line in text.splitlines() if "forward_backward" in line).split()
    assert fb == ["compute/forward_backward", "1.500", "75.0%"]
    assert text.index("forward_backward") < text.index("all_reduce") < text.index("total")


def test_dtlab_train_into_a_pipe_writes_no_escape_codes(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    sets = ["train.steps=4", *TINY_LM, "logging.log_every=2", "train.eval_every=0", "backend.world_size=2"]
    sets.append(f"logging.run_dir={tmp_path}")
    cmd = [sys.executable, "-m", "dtlab", "train", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stream in (proc.stdout, proc.stderr):
        assert ESC not in stream and "\r" not in stream
    assert "step     2 | loss" in proc.stderr and "progress 4/4 (100%)" in proc.stderr
    assert "dtlab train: summary" in proc.stdout and "where step time goes" in proc.stdout
