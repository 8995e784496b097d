"""docs/architecture.md names things that exist: every file or folder it cites (in full, or by its
tail inside a package: ``compose/_build.py``), every ``file.py: Name`` defined in that file, every
``dtlab.module.name`` importable. Its import table is checked against the enforced one in
tests/test_layers.py."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TOPS = ("dtlab", "tests", "docs", "scripts", "examples", "benchmarks")
PATH = re.compile(r"^[\w.-]+(/[\w.-]*)*$")


def _spans() -> list[str]:
    """Every inline code span, whitespace joined (a span may wrap); fenced blocks left out."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


def _repo_paths() -> list[str]:
    """Every file and folder of the checkout's code, tests and docs, relative, folders ending in /."""
    found = []
    for top in TOPS:
        for p in (ROOT / top).rglob("*"):
            if "__pycache__" not in p.parts:
                found.append(p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else ""))
    return [*found, *(f"{top}/" for top in TOPS if (ROOT / top).is_dir())]


def _cited_paths() -> set[str]:
    cited = set()
    for span in _spans():
        if "*" in span or "<" in span:  # a pattern (``_conformance_*.py``), not a path
            continue
        for part in re.split(r"[\s,:()=\[\]{}\"'|+]+", span):
            if PATH.match(part) and ("/" in part or part.endswith((".py", ".md"))):
                cited.add(part)
    return cited


def test_every_cited_path_exists() -> None:
    paths = _repo_paths()
    cited = _cited_paths()
    assert len(cited) > 100  # the map names the files of every package
    missing = sorted(
        c for c in cited if not any(p in (c, c + "/") or p.endswith(("/" + c, "/" + c + "/")) for p in paths)
    )
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_file_colon_name_is_defined_in_that_file() -> None:
    pairs = [m.groups() for s in _spans() if (m := re.match(r"^([\w/.]+\.py): (\w+)$", s))]
    assert pairs
    wrong = []
    for path, name in pairs:
        files = [f for f in ROOT.joinpath("dtlab").rglob("*.py") if f.as_posix().endswith("/" + path)]
        defined = re.compile(rf"^\s*((def|class)\s+{name}\b|{name}\s*[:=])", re.M)
        if not any(defined.search(f.read_text()) for f in files):
            wrong.append(f"{path}: {name}")
    assert not wrong, f"docs/architecture.md: not defined where it says: {wrong}"


def test_every_dotted_dtlab_name_imports() -> None:
    names = {m.group(0) for s in _spans() if (m := re.match(r"^dtlab(\.\w+)+", s))}
    assert names
    missing = []
    for dotted in sorted(names):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
            try:
                obj: object = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(dotted)
            break
    assert not missing, f"docs/architecture.md names what does not import: {missing}"
