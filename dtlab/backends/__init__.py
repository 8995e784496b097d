"""Communication backends: one interface, several engines."""

from dtlab.backends.base import CommunicationBackend, CompletedWork, P2POp, ReduceOp, Work
from dtlab.backends.init import detect_launcher, init_backend
from dtlab.backends.inmemory import InMemoryBackend, InMemoryWorld
from dtlab.backends.mesh import Mesh, MeshLike
from dtlab.backends.mpi import MPIBackend
from dtlab.backends.stats import CommStats, OpStats
from dtlab.backends.torch_dist import GlooBackend, NCCLBackend, TorchDistBackend

__all__ = [
    "CommStats",
    "CommunicationBackend",
    "CompletedWork",
    "GlooBackend",
    "InMemoryBackend",
    "InMemoryWorld",
    "MPIBackend",
    "Mesh",
    "MeshLike",
    "NCCLBackend",
    "OpStats",
    "P2POp",
    "ReduceOp",
    "TorchDistBackend",
    "Work",
    "detect_launcher",
    "init_backend",
]
