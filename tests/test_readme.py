"""The README's Python example runs as printed (4 in-memory ranks) and reports sharded memory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs_as_printed(capsys: Any) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, f"expected one python block in README.md, found {len(blocks)}"
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    results = eval(compile("run_world(2, train, timeout=60, steps=3)", "check", "eval"), namespace)
    assert len(results) == 2
    for loss, memory in results:
        assert loss == loss and loss >= 0  # finite, not NaN
        # ZeRO-2 at 4 ranks in the printed run, 2 here: gradients are half of the parameters
        assert memory["gradients"] * 2 == memory["parameters"]
    assert "[(" in capsys.readouterr().out  # the example printed its 4 ranks' results
