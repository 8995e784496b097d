"""The import rule of docs/architecture.md, section "Layers": every package imports only downwards.

Imports under ``if TYPE_CHECKING:`` are annotations only: the layer rule does not count them, the
module circle check does (an annotation circle is still two modules that must be read together).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dtlab"

# package -> the dtlab packages it may import at run time (itself included)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "untrusted": set(),
    "backends": {"errors"},
    "core": {"backends", "errors", "untrusted"},
    "compression": {"core", "backends", "errors"},
    "models": {"core", "backends", "errors", "untrusted"},
    "data": {"errors"},
    "checkpoint": {"models", "core", "backends", "errors", "untrusted"},
    "optimizers": {"checkpoint", "models", "compression", "core", "backends", "errors", "untrusted"},
    "testing": {"optimizers", "backends", "errors"},
    "advise": {"zoo", "models", "core", "backends", "errors"},
    "zoo": {"models", "core", "backends", "errors"},
    "lr_schedule": set(),
    "yaml_strict": set(),
    "config_sections": {"core", "backends", "errors", "untrusted"},
    "config_files": {"errors", "untrusted", "yaml_strict"},
    "parallel_config": {"config_files", "zoo", "models", "core", "backends", "errors"},
    "config": {
        "config_files", "config_sections", "parallel_config", "lr_schedule", "yaml_strict", "core", "errors",
        "untrusted",
    },
    "config_doc": {
        "config", "config_sections", "parallel_config", "lr_schedule", "yaml_strict", "core", "errors",
    },
    "trainers": {
        "config", "config_sections", "parallel_config", "lr_schedule", "yaml_strict", "zoo", "data",
        "optimizers", "checkpoint", "models", "compression", "core", "backends", "errors", "untrusted",
    },
    "benchmarks": {
        "trainers", "advise", "testing", "config", "config_sections", "parallel_config", "lr_schedule",
        "zoo", "data", "optimizers", "checkpoint", "models", "compression", "core", "backends", "errors",
        "untrusted",
    },
    "cli": {
        "config_doc", "benchmarks", "trainers", "advise", "config", "config_sections", "parallel_config",
        "zoo", "data", "optimizers", "checkpoint", "models", "compression", "core", "backends", "errors",
        "untrusted",
    },
    "__main__": {"cli"},
}  # fmt: skip


def _runtime_imports(tree: ast.AST, annotations: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import, inside functions too; ``annotations``: those under
    ``if TYPE_CHECKING:`` as well."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not annotations and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.lineno, child.module))
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            visit(child)

    visit(tree)
    return found


def _files(package: str) -> list[Path]:
    path = ROOT / package
    return sorted(path.rglob("*.py")) if path.is_dir() else [ROOT / f"{package}.py"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downwards(package: str) -> None:
    allowed = ALLOWED[package] | {package}
    bad = []
    for file in _files(package):
        for line, module in _runtime_imports(ast.parse(file.read_text(), str(file))):
            parts = module.split(".")
            if parts[0] == "dtlab" and len(parts) > 1 and parts[1] not in allowed:
                bad.append(f"{file.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, f"dtlab.{package} may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_backends_never_import_torch_nn() -> None:
    bad = [
        f"{file.relative_to(ROOT.parent)}:{line}"
        for file in _files("backends")
        for line, module in _runtime_imports(ast.parse(file.read_text()))
        if module == "torch.nn" or module.startswith("torch.nn.")
    ]
    assert not bad, f"backends import torch.nn: {bad}"


def test_cited_architecture_sections_exist() -> None:
    """Source files cite docs/architecture.md by section; every cited section is a heading there."""
    doc = ROOT.parent / "docs" / "architecture.md"
    headings = {line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")}
    cited = re.compile(r'architecture\.md,?\s+(?:section\s+)?\(?"([^"]+)"', re.S)
    missing = []
    for file in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "tests").glob("*.py")]):
        for section in cited.findall(file.read_text()):
            if section not in headings:
                missing.append(f"{file.name}: {section!r}")
    assert not missing, f"sections cited but not in docs/architecture.md: {missing}"


def _packages() -> set[str]:
    """Every package and top-level module of dtlab (``__init__`` holds only the version)."""
    return {
        p.name.removesuffix(".py")
        for p in ROOT.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    } - {"__init__"}


def test_every_package_and_module_has_a_row() -> None:
    """A new package or top-level module gets a row in ALLOWED (and docs/architecture.md's table)."""
    assert _packages() == set(ALLOWED), f"missing rows: {sorted(_packages() - set(ALLOWED))}"


def _documented_table() -> dict[str, set[str]]:
    """docs/architecture.md's import table: package -> the packages its row names (parentheses are
    comments; "nothing from dtlab" names none)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    start = text.index("| package | may import (besides itself) |")
    rows: dict[str, set[str]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        packages, allowed = line.split("|")[1:3]
        while re.search(r"\([^()]*\)", allowed):
            allowed = re.sub(r"\([^()]*\)", "", allowed)
        for package in re.findall(r"`([\w.]+)`", packages):
            rows[package] = set(re.findall(r"`([\w.]+)`", allowed))
    return rows


def test_documented_import_table_is_the_enforced_one() -> None:
    documented = _documented_table()
    assert set(documented) == set(ALLOWED), f"rows differ: {sorted(set(documented) ^ set(ALLOWED))}"
    wrong = {
        p: sorted(documented[p] ^ (ALLOWED[p] - {p})) for p in ALLOWED if documented[p] != ALLOWED[p] - {p}
    }
    assert not wrong, f"docs/architecture.md's import table is not ALLOWED (the names in one only): {wrong}"


def test_only_benchmarks_import_the_testing_helpers() -> None:
    """Production code runs without dtlab.testing (the in-memory engine is dtlab.backends.threads)."""
    bad = [
        f"{file.relative_to(ROOT.parent)}:{line}"
        for package in sorted(set(ALLOWED) - {"testing", "benchmarks"})
        for file in _files(package)
        for line, module in _runtime_imports(ast.parse(file.read_text()))
        if module == "dtlab.testing" or module.startswith("dtlab.testing.")
    ]
    assert not bad, f"production code imports dtlab.testing: {bad}"


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
    """Fails naming the first circle found in ``graph`` (node -> the nodes it imports)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(f"import circle: {' -> '.join([*path[path.index(node) :], node])}")
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_no_import_circles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for package in ALLOWED:
        for file in _files(package):
            for _, module in _runtime_imports(ast.parse(file.read_text())):
                parts = module.split(".")
                if parts[0] == "dtlab" and len(parts) > 1 and parts[1] != package and parts[1] in ALLOWED:
                    graph.setdefault(package, set()).add(parts[1])
    _assert_no_circle(graph)


# Inside dtlab.models: one subpackage per parallelism, composed in compose/. A subpackage imports the
# top-level modules (base, placed_state, ...) and the subpackages named here; top-level modules other
# than __init__ import no subpackage.
MODELS_SUBPACKAGES: dict[str, set[str]] = {
    "dp": set(),
    "tensor": set(),
    "pipeline": set(),
    "compose": {"dp", "tensor", "pipeline"},
}


def test_models_subpackages_import_only_their_parts() -> None:
    models = ROOT / "models"
    found = {p.name for p in models.iterdir() if (p / "__init__.py").exists()}
    assert found == set(MODELS_SUBPACKAGES), f"dtlab.models subpackages without a row: {sorted(found)}"
    bad = []
    for file in sorted(models.rglob("*.py")):
        relative = file.relative_to(models).parts
        own = relative[0] if len(relative) > 1 else None
        if own is None and relative[0] == "__init__.py":
            continue
        allowed = MODELS_SUBPACKAGES[own] | {own} if own else set()
        for line, module in _runtime_imports(ast.parse(file.read_text(), str(file))):
            parts = module.split(".")
            inside = parts[:2] == ["dtlab", "models"] and len(parts) > 2
            if inside and parts[2] in found and parts[2] not in allowed:
                bad.append(f"{file.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, "dtlab.models subpackages import only downwards:\n" + "\n".join(bad)


def _module_name(file: Path) -> str:
    parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the dtlab modules it imports, ``if TYPE_CHECKING:`` too (``from package import
    module`` names the module)."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, file in files.items():
        tree = ast.parse(file.read_text())
        imported = {module for _, module in _runtime_imports(tree, annotations=True)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in imported:
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {module for module in imported if module in files and module != name}
    return graph


def test_no_import_circles_between_modules() -> None:
    """No module imports another that imports it back, directly or around a circle, counting imports
    inside functions (a lazy import is still a circle: config <-> parallel_config) and annotation
    imports (a private part of a backend, of the config or of the composition naming the class it is a
    part of; it takes a Protocol beside it, explicit arguments or a type parameter instead)."""
    _assert_no_circle(_module_graph())


# The Trainer's helpers take what they need (explicit arguments or a Protocol beside them), never
# the Trainer; only these modules name dtlab.trainers.trainer (the package's exports and run_training).
TRAINER_IMPORTERS = {"dtlab.trainers", "dtlab.trainers.launch"}


def test_trainer_helpers_do_not_import_the_trainer() -> None:
    graph = _module_graph()
    importers = {name for name, imported in graph.items() if "dtlab.trainers.trainer" in imported}
    helpers = {name for name in importers if name.startswith("dtlab.trainers")}
    assert helpers == TRAINER_IMPORTERS, f"modules of dtlab.trainers importing the Trainer: {sorted(helpers)}"


def test_no_module_over_400_lines() -> None:
    """A file a reader can hold in mind: every module of dtlab is at most 400 lines (split by what it
    does, as the strategies' communication helpers and checks sit beside them)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines (split them by what they do): {long}"
