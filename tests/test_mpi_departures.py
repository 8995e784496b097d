"""The ended-rank notices of a world ``MPIBackend`` (``_mpi_departures.py``) live on a duplicate of
``COMM_WORLD`` kept until the process exits; MPI has a limited number of communicators (MPICH: 2046
world backends built and closed in one process, then ``MPI_Comm_dup`` fails). That failure names the
cause and the fixes instead of MPI's raw error stack. In process, with a fake MPI."""

from __future__ import annotations

from typing import Any

import pytest

from dtlab.backends._mpi_departures import Departures
from dtlab.errors import BackendInitError


class _MPIError(Exception):
    pass


class _World:
    def Dup(self) -> _World:
        raise _MPIError("Other MPI error, error stack: MPI_Comm_dup(MPI_COMM_WORLD) failed")


class _FakeMPI:
    Exception = _MPIError


def test_a_failed_duplicate_names_the_communicator_limit_and_the_fixes() -> None:
    mpi: Any = _FakeMPI()
    with pytest.raises(BackendInitError, match=r"MPI_Comm_dup.*failed\).*too many world backends.*"
                       r"build one and reuse it, or pass watchdog=None"):  # fmt: skip
        Departures(mpi, _World())
