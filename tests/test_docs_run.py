"""Every Python block in README.md and docs/ runs as printed, or says it is a fragment.

A block is a complete program (imports, set-up, in-memory ranks) unless its first line is a comment
starting with ``# fragment``. Every complete block runs here, in this one process, in a fresh
namespace; the blocks keep their step counts tiny so the whole file stays fast.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment"


def _blocks() -> list[tuple[str, int, str]]:
    """(file, line of the opening fence, code) of every ```python block."""
    out = []
    for path in FILES:
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 1
            out.append((str(path.relative_to(ROOT)), line, m.group(1)))
    return out


BLOCKS = _blocks()
COMPLETE = [b for b in BLOCKS if not b[2].lstrip().startswith(FRAGMENT)]


def test_every_block_is_complete_or_marked_as_a_fragment() -> None:
    assert len(BLOCKS) >= 15, [f"{f}:{n}" for f, n, _ in BLOCKS]
    assert len(COMPLETE) >= 10  # most blocks are programs, not fragments
    for name, line, code in BLOCKS:
        first = code.lstrip().splitlines()[0]
        if first.startswith(FRAGMENT):  # a fragment says what it is part of
            assert len(first) > len(FRAGMENT) + 10, f"{name}:{line}: say what the fragment belongs to"
        else:  # a program imports what it uses: at least one import, before anything else runs
            assert re.search(r"^(import|from) ", code, re.M), f"{name}:{line}: no import"


@pytest.mark.parametrize("name,line,code", COMPLETE, ids=[f"{f}:{n}" for f, n, _ in COMPLETE])
def test_block_runs_as_printed(
    name: str, line: int, code: str, capsys: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files (runs/, checkpoints) writes them here
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, f"{name}:{line}", "exec"), namespace)
    out = capsys.readouterr().out
    if name == "README.md":  # its printed ranks: ZeRO-2 at 4 ranks holds a quarter of the gradients
        results = namespace["run_world"](2, namespace["train"], timeout=60, steps=3)
        for loss, memory in results:
            assert loss == loss and loss >= 0
            assert memory["gradients"] * 2 == memory["parameters"]
        assert "[(" in out
