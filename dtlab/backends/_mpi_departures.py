"""Which ranks of an MPI world have ended their script, so that a peer left waiting is named at once.

A rank whose script ends (its loop was one batch shorter: uneven inputs; or it called ``sys.exit``)
does not die: it waits in ``MPI_Finalize``, so the launcher sees nothing wrong, and a peer waiting in
a collective it will never join waits for it. Gloo names such a peer at once (its connection closes);
here the world backend does the same: at the interpreter's exit (``atexit``, which runs before
mpi4py's ``MPI_Finalize``) each rank sends every other rank one small message on a duplicate of
``COMM_WORLD`` saying it has ended, and the watchdog thread reads them (:meth:`Departures.read`).

The watchdog ends the job only where that proves a hang: a *symmetric* collective (all-reduce,
all-gather, reduce-scatter, all-to-all, barrier, group creation: every member's result needs every
member's input, so a member that completed one saw everyone enter it) on a communicator with an
ended member, still running ``grace`` seconds after both its start and the notice (the time its last
data needs to arrive). A rooted operation (broadcast, reduce) or a receive may legitimately wait for
a live rank after another ended; those wait for the watchdog's own time.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

from dtlab.errors import BackendInitError

__all__ = ["SYMMETRIC", "Departures"]

#: the operations (``what`` prefixes) no member completes before every member entered them
SYMMETRIC = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier", "new_group", "split")

_TAG = 1


class Departures:
    """The notices of ended ranks of one world (``comm``: ``COMM_WORLD``; collective: ``Dup``)."""

    def __init__(self, mpi: Any, comm: Any) -> None:
        self._mpi = mpi
        try:
            self._comm = comm.Dup()
        except mpi.Exception as exc:
            raise BackendInitError(
                f"MPIBackend: duplicating COMM_WORLD for the ended-rank notices failed ({exc}). Each world "
                "MPIBackend keeps such a duplicate until the process exits (it sends the notice at exit, "
                "after close() too), and MPI has a limited number of communicators (MPICH: about 2000), "
                "so the likely cause is too many world backends built in this process: build one and "
                "reuse it, or pass watchdog=None to those built for a moment (no watchdog, no notices)"
            ) from exc
        self._me, self._size = comm.Get_rank(), comm.Get_size()
        self._note = bytearray(8)
        self._status = mpi.Status()
        #: world rank -> when this rank read its notice (``time.monotonic``)
        self.ended: dict[int, float] = {}
        self._sent = False
        atexit.register(self.announce)

    def announce(self) -> None:
        """Tell every other rank that this one has ended (once; never blocks: 8-byte sends)."""
        mpi = self._mpi
        if self._sent or not mpi.Is_initialized() or mpi.Is_finalized():
            return
        self._sent = True
        for peer in range(self._size):
            if peer != self._me:
                self._comm.Isend([self._note, mpi.BYTE], peer, _TAG).Free()

    def read(self) -> dict[int, float]:
        """Every notice that arrived since the last call (the watchdog thread's, once per wake)."""
        mpi, status = self._mpi, self._status
        while self._comm.Iprobe(mpi.ANY_SOURCE, _TAG, status):
            source = status.Get_source()
            self._comm.Recv([bytearray(8), mpi.BYTE], source, _TAG)
            self.ended.setdefault(source, time.monotonic())
        return self.ended
