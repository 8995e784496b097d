"""An MPI job never hangs where torch.distributed would end it: a rank that finished its loop early
(uneven inputs) or left with ``sys.exit(n)`` while its peer waits in a collective (MPI has no
time-outs: the peer waited for ever, the leaving rank in ``MPI_Finalize``) ends the job within
seconds, with one message naming the operation, its number, the rank that ended and the fix; a peer
that hangs alive ends it after the MPIBackend's watchdog time."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = """
import sys, torch
from dtlab.backends import init_backend
polled = sys.argv[1] == "return"  # polled: every wait raises after timeout; else blocking, watched
b = init_backend("mpi", timeout=60.0 if polled else None, watchdog=8.0, check_collectives=False)
g = b if polled else b.new_group([0, 1])  # a group's waits are watched too
steps = 3 if b.rank == 0 else 2  # uneven inputs: rank 1's data is one batch shorter
for step in range(steps):
    if sys.argv[1] == "exit" and b.rank == 1 and step == 1:
        sys.exit(3)  # no exception an excepthook sees: the rank waits in MPI_Finalize
    g.all_reduce(torch.ones(4))
print(f"rank {b.rank} left its loop", flush=True)
"""


def test_a_rank_that_left_early_ends_the_job_naming_the_collective(tmp_path: Path) -> None:
    """``mpiexec -n 2 python script.py``, rank 1 one step short: it returns while rank 0 waits in its
    third all-reduce (or calls ``sys.exit(3)`` in a group's loop while rank 0 waits in its second).
    Both jobs hung for ever (killed after 90 s); rank 0's watchdog now hears that rank 1 ended, and 4 s
    later (half its 8 s, at most 10 s) ends the job, or, polled (``timeout=60``), the wait raises
    ``CollectiveTimeoutError`` saying so, which ends the job uncaught."""
    from processes import run_groups

    script = tmp_path / "uneven.py"
    script.write_text(SCRIPT)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmds = {how: [mpiexec, "-n", "2", sys.executable, str(script), how] for how in ("return", "exit")}
    t0 = time.monotonic()
    done = run_groups(cmds, timeout=90)  # both at once, each its own process group, killed after 90 s
    assert time.monotonic() - t0 < 60
    for how, proc in done.items():
        out = proc.stdout + proc.stderr
        n = 3 if how == "return" else 2  # rank 0 waits in its third (its second) all-reduce
        want = f"rank 0: MPI all_reduce (operation #{n} of this rank on its communicator) can never "
        want += "complete: rank 1 has ended (the script returned or called sys.exit()) without calling it"
        assert want in out and "Uneven inputs" in out and "DistributedSampler" in out, (how, out[-3000:])
        assert "MPI_Abort" in out and proc.returncode != 0, (how, proc.returncode, out[-3000:])
        assert ("CollectiveTimeoutError: " + want in out) is (how == "return"), out[-3000:]  # raised
        assert "rank 0 left its loop" not in out, (how, out[-3000:])


def test_the_default_is_bounded() -> None:
    """Without ``timeout``, MPIBackend and init_backend watch blocking calls for NCCL's 600 s."""
    from dtlab.backends import MPIBackend, init_backend

    for fn in (MPIBackend, init_backend):
        assert inspect.signature(fn).parameters["watchdog"].default == 600.0


class _RunningMPI:
    """What a Watchdog reads of mpi4py's ``MPI`` module: MPI running at MPI_THREAD_MULTIPLE, over
    ``world`` (``status``: the class of ``MPI.Status``)."""

    THREAD_MULTIPLE, ANY_SOURCE, BYTE = 3, -1, "byte"

    def __init__(self, world: object, status: type = object) -> None:
        self.COMM_WORLD, self.Status = world, status

    def Query_thread(self) -> int:
        return 3

    def Is_initialized(self) -> bool:
        return True

    def Is_finalized(self) -> bool:
        return False


def test_the_watchdog_prints_the_stuck_operation_then_aborts(capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.backends._mpi_wait import Watchdog

    calls: list[int] = []

    class World:
        def Abort(self, code: int) -> None:
            calls.append(code)

    mpi: Any = _RunningMPI(World())
    dog = Watchdog(mpi, 0.3, rank=5)
    done, stuck = dog.slot(), dog.slot()
    done.begin("barrier")
    done.current = None  # completed: never reported
    stuck.begin("all_gather")
    stuck.begin("broadcast")  # its second operation
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert calls == [1]
    err = capsys.readouterr().err
    assert (
        "rank 5: MPI broadcast (operation #2 of this rank on its communicator) did not complete within 0.3s"
        in err
    )
    assert "MPIBackend(watchdog=seconds)" in err and "barrier" not in err


def test_an_ended_rank_fails_only_symmetric_collectives_it_belongs_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Rank 1 ended: a barrier with it is named once the grace has passed; an all-reduce of a group
    without it, and a broadcast (rooted: its root may be another, live rank), are not."""
    from dtlab.backends._mpi_wait import Watchdog

    calls: list[str] = []

    class Probed:
        source = -1

        def Get_source(self) -> int:
            return self.source

    class Comm:
        def __init__(self) -> None:
            self.notes = [1]

        def Dup(self) -> Comm:
            return self

        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 3

        def Iprobe(self, source: int, tag: int, status: Probed) -> bool:
            if self.notes:
                status.source = self.notes[0]
            return bool(self.notes)

        def Recv(self, buf: object, source: int, tag: int) -> None:
            self.notes.remove(source)

        def Isend(self, buf: object, dest: int, tag: int) -> Any:
            calls.append(f"notice to {dest}")
            return Comm  # anything with Free()

        @staticmethod
        def Free() -> None: ...

        def Abort(self, code: int) -> None:
            calls.append(f"abort {code}")

    mpi: Any = _RunningMPI(Comm(), Probed)
    dog = Watchdog(mpi, 3.0, rank=0, world=mpi.COMM_WORLD)  # grace 1.5 s
    dog.slot(frozenset({0, 1})).begin("broadcast")
    dog.slot(frozenset({0, 2})).begin("all_reduce")
    t0 = time.monotonic()
    dog.slot(frozenset({0, 1, 2})).begin("barrier")
    while not calls and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    dog.stop()
    # the grace (1.5 s), then the abort's 1 s pause for the launcher to forward the message
    assert calls == ["abort 1"] and 2.4 < time.monotonic() - t0 < 8, (calls, time.monotonic() - t0)
    err = capsys.readouterr().err
    assert (
        "rank 0: MPI barrier (operation #1 of this rank on its communicator) can never complete: rank 1"
        in err
    )
    assert "broadcast" not in err and "all_reduce" not in err


RANK_1_HANGS = """
import sys, time

import dtlab.trainers.launch as launch
from dtlab import cli

real = launch._rank_main


def rank_main(backend, *args):
    if backend.rank == 1:  # alive, never calling: rank 0 waits in its first collective
        time.sleep(120)
    return real(backend, *args)


launch._rank_main = rank_main
sys.argv[1:] = ["train", *sys.argv[1:]]
sys.exit(cli.main())
"""


def test_dtlab_train_under_mpiexec_ends_a_hung_collective_after_backend_timeout(tmp_path: Path) -> None:
    """``dtlab train`` builds the MPI backend with MPI's blocking calls under the watchdog, its time
    ``backend.timeout`` (it polled every operation, 1.2-1.5x on a 4 KiB collective at 2 ranks): a peer
    hung alive ends the job after it, the operation and the setting named."""
    from processes import run_group

    from dtlab.testing import TINY_LM

    script = tmp_path / "rank_1_hangs.py"
    script.write_text(RANK_1_HANGS)
    sets = [
        "train.steps=2",
        *TINY_LM,
        f"logging.run_dir={tmp_path}/run",
        "backend.name=mpi",
        "backend.timeout=4",
    ]
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, str(script)]
    t0 = time.monotonic()
    proc = run_group(cmd + [a for s in sets for a in ("--set", s)], timeout=90)
    assert time.monotonic() - t0 < 60, proc.stderr[-3000:]
    err = proc.stderr
    assert "rank 0: MPI " in err and "did not complete within 4s" in err, err[-3000:]
    assert "The MPI watchdog ends the job now" in err and "backend.timeout" in err, err[-3000:]
    assert proc.returncode != 0
