"""An MPI job of several ranks ends when a script's exception on one rank is not caught.

Without this, ``mpiexec -n 2 python train.py`` hangs for ever when one rank raises: Python prints the
traceback, then mpi4py's exit hook waits in ``MPI_Finalize`` for ranks that wait in their next
collective (MPI has no time-outs), and the launcher waits for both. ``python -m mpi4py train.py``
avoids it; a world ``MPIBackend`` gives a plain ``python train.py`` the same: from its construction to
its ``close()`` (or after it, when it closed while the exception was on its way out), an uncaught
exception is printed as Python prints it (by the ``sys.excepthook`` in place before) and then ends the
job with ``MPI.COMM_WORLD.Abort`` (exit status 1; 130 for Ctrl-C), as ChainerMN's hook and
``mpi4py.run`` do. The launcher then stops every rank and exits non-zero.
"""

from __future__ import annotations

import signal
import sys
import time
from types import TracebackType
from typing import Any

__all__ = ["AbortOnUncaught", "end_mpi_job"]

#: seconds between flushing this rank's output and the abort: the launcher's proxy forwards a rank's
#: output from its pipe on its own schedule, and an abort before it read the last lines loses them (a
#: known MPI_Abort effect; seen once here: the error line of a failing rank missing from the job's output)
_FORWARD_GRACE_S = 1.0


class AbortOnUncaught:
    """``sys.excepthook`` chained to the one in place, ending the MPI job after it printed; removed by
    :meth:`remove` (only where no later hook replaced it)."""

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._previous = sys.excepthook
        sys.excepthook = self.hook

    def hook(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            self._previous(kind, exc, tb)
            # said here, not only by MPI_Abort's own line: the launcher may not forward that one
            rank = self._mpi.COMM_WORLD.Get_rank()
            print(
                f"rank {rank}: the uncaught {kind.__name__} above ends the MPI job (MPI_Abort), so that "
                "no other rank waits for this one",
                file=sys.stderr,
            )
        finally:
            end_mpi_job(self._mpi, 128 + signal.SIGINT if issubclass(kind, KeyboardInterrupt) else 1)

    def remove(self) -> None:
        """Put the previous hook back, unless an exception is on its way out (the backend closed in a
        ``finally:`` or a ``with`` block's exit): uncaught, it must still end the job."""
        if sys.excepthook == self.hook and sys.exc_info()[1] is None:
            sys.excepthook = self._previous


def end_mpi_job(mpi: Any, code: int) -> None:
    """End the MPI job with exit status ``code`` (``MPI.COMM_WORLD.Abort``, this process's output
    flushed first, with a moment for the launcher to forward it), where MPI is running: the launcher
    stops every rank."""
    if mpi.Is_initialized() and not mpi.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(_FORWARD_GRACE_S)
        mpi.COMM_WORLD.Abort(code)
