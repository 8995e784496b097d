"""docs/strategies.md's table of advise's predictions against dtlab's runs ("How exact it is") holds
today's figures: every row's predicted bytes are what ``dtlab advise`` predicts now, and every measured
figure equals the predicted one. The runs themselves are tests/test_advise_runs.py's and
tests/test_advise_pipeline_runs.py's (they assert measured == predicted on the same plans), so a change
of advise or of a strategy's bytes fails one of them or this test until the table is printed again with
``python -m dtlab.benchmarks.advise_accuracy``."""

from __future__ import annotations

import re
from pathlib import Path

from dtlab.benchmarks.advise_accuracy import HEAD, grid, predicted

DOC = Path(__file__).resolve().parents[1] / "docs" / "strategies.md"


def _table() -> dict[str, list[str]]:
    text = DOC.read_text()
    start = text.index("| " + " | ".join(HEAD) + " |")
    lines = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in rows}


def _number(text: str) -> int | None:
    return None if text == "-" else int(text.replace(",", ""))


def test_the_documented_table_is_what_advise_predicts_and_the_runs_measure() -> None:
    table = _table()
    labels = []
    for spec, plan in grid():
        for r in range(plan.pp):
            label, want = predicted(spec, plan, r)
            labels.append(label)
            assert label in table, f"docs/strategies.md lacks the row {label!r}"
            documented = table[label]
            doc_pred = [_number(c.split(" / ")[0]) for c in documented]
            assert doc_pred == want, f"{label}: documented {documented}, advise predicts {want}"
            for cell in documented:  # measured as predicted: no difference in brackets
                assert re.fullmatch(r"-|([\d,]+) / (\1|-)", cell), f"{label}: {cell}"
    assert list(table) == labels
