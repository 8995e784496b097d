"""Run a function on N ranks: threads of one process (``run_world``) or real processes (``spawn_world``)."""

from dtlab.testing.spawn import spawn_world
from dtlab.testing.world import run_world

__all__ = ["run_world", "spawn_world"]
