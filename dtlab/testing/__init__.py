"""Run a function on N ranks: threads of one process (``run_world``) or real processes (``spawn_world``)."""

from dtlab.backends.threads import run_world
from dtlab.testing.configs import TINY_LM
from dtlab.testing.elastic import Join, Kill, run_elastic
from dtlab.testing.spawn import spawn_world

__all__ = ["TINY_LM", "Join", "Kill", "run_elastic", "run_world", "spawn_world"]
