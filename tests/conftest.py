"""Suite-wide settings.

``./test.sh`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). Tests that start
processes (a spawned gloo/MPI world, ``torchrun``, ``mpiexec``, ``python -m dtlab``) go to one xdist
group, so they run one at a time on one worker while the other worker runs in-memory tests: two
multi-process worlds never compete for the two cores, and their time limits hold. A test is such a
test when its function, or a module-level function it calls (two levels deep), names one of
``PROCESS_WORDS``.

Every test starts with one intra-op thread (``_one_thread``): the count is process-wide, and a test that
changed it (an in-process one-rank gloo Trainer sets it from the core count) would otherwise change
the rounding, and so the results, of the tests after it in that worker.
"""

from __future__ import annotations

import inspect
from types import FunctionType, ModuleType
from typing import Any

import pytest
import torch

PROCESS_WORDS = (
    "spawn_world",
    "subprocess",
    "torchrun",
    "mpiexec",
    "Popen",
    "run_elastic_torchrun",
    "run_group",
)


def _source(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _starts_processes(
    fn: FunctionType,
    module: ModuleType | None,
    seen: dict[tuple[FunctionType, str, int], bool],
    depth: int = 2,
) -> bool:
    """``seen``: the answers so far in this collection (``inspect.getsource`` is slow: once per function,
    not once per word and per test)."""
    key = (fn, getattr(module, "__name__", ""), depth)
    if key not in seen:
        source = _source(fn)
        seen[key] = any(w in source for w in PROCESS_WORDS) or _calls_one(fn, module, seen, depth)
    return seen[key]


def _calls_one(
    fn: FunctionType, module: ModuleType | None, seen: dict[tuple[FunctionType, str, int], bool], depth: int
) -> bool:
    if depth == 0 or module is None:
        return False
    names = set(getattr(fn, "__code__", None).co_names) if hasattr(fn, "__code__") else set()
    for name in names:
        called = getattr(module, name, None)
        if isinstance(called, FunctionType) and called.__module__ == module.__name__:
            if _starts_processes(called, module, seen, depth - 1):
                return True
    return False


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[tuple[FunctionType, str, int], bool] = {}
    for item in items:
        fn = getattr(item, "function", None)
        if isinstance(fn, FunctionType) and _starts_processes(fn, getattr(item, "module", None), seen):
            item.add_marker(pytest.mark.xdist_group("processes"))
