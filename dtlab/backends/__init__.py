"""Communication backends: one interface, several engines."""

from dtlab.backends.base import CommunicationBackend, CompletedWork, ReduceOp, Work
from dtlab.backends.inmemory import InMemoryBackend, InMemoryWorld
from dtlab.backends.stats import CommStats, OpStats

__all__ = [
    "CommStats",
    "CommunicationBackend",
    "CompletedWork",
    "InMemoryBackend",
    "InMemoryWorld",
    "OpStats",
    "ReduceOp",
    "Work",
]
