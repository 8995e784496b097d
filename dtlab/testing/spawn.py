"""``spawn_world``: run ``fn(backend, ...)`` on N real processes (gloo or MPI) and collect the results.

gloo: ``world_size`` Python processes rendezvous over TCP on 127.0.0.1 at a free port. mpi: one
``mpiexec -n N`` (found next to ``sys.executable`` or on ``PATH``). Each process imports ``fn`` by
module and qualified name (it must be a module-level function), reads ``args``/``kwargs`` from a
pickle in a private temporary directory and writes back its result or its traceback. Every wait is
bounded by ``timeout``; on a failure or a timeout every process of the world is killed by PID.
"""

from __future__ import annotations

import gc
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtlab.backends._checked import ENV_VAR
from dtlab.backends._run_args import check_fn, check_may_die, check_timeout, check_world_size
from dtlab.errors import ArgumentError, BackendInitError, CollectiveTimeoutError, RankFailedError

__all__ = ["find_mpiexec", "spawn_world"]

_WORKER = "from dtlab.testing.spawn import _worker_main; _worker_main()"


def find_mpiexec() -> str:
    """``mpiexec`` next to this Python (a venv with the ``mpich`` wheel) or on ``PATH``."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise BackendInitError(
            f"spawn_world(backend='mpi') needs mpiexec: none next to {sys.executable} or on PATH; "
            "pip install mpich mpi4py"
        )
    return found


def _fn_reference(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname:
        raise ArgumentError(
            f"spawn_world: fn must be a module-level function that other processes can import, got "
            f"{fn!r} (qualname {qualname!r}); move it to module level"
        )
    path = getattr(sys.modules.get(module), "__file__", None) if module == "__main__" else None
    return module, qualname, path


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, env.get("PYTHONPATH", "")]).keys()).strip(
        os.pathsep
    )
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def spawn_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    backend_timeout: float | None = None,
    may_die: Sequence[int] = (),
    check_collectives: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(backend, *args, **kwargs)`` on ``world_size`` processes; return results in rank order.

    ``backend`` is "gloo" or "mpi"; ``timeout`` (seconds) bounds the whole world, ``backend_timeout``
    each operation (default: ``timeout``). Raises :class:`RankFailedError` naming the first rank that
    failed (with its traceback text) and :class:`CollectiveTimeoutError` naming the ranks that had not
    finished when ``timeout`` ran out. Arguments and results travel pickled.

    ``may_die`` (gloo only) lists ranks whose process may end without a result (to test how the
    survivors react to a dead peer); their result is None. Under MPI a dead process ends the job:
    the launcher kills the others and exits non-zero, reported as a :class:`RankFailedError`.

    ``check_collectives`` (default on, as tests want it) runs every backend of the world in checked
    mode (``DTLAB_CHECK_COLLECTIVES``): ranks compare each collective call before it runs, and a
    mismatch is a :class:`CollectiveMismatchError` on every rank. Benchmarks turn it off.
    """
    if backend not in ("gloo", "mpi"):
        raise ArgumentError(f"spawn_world: backend must be 'gloo' or 'mpi', got {backend!r}")
    check_world_size("spawn_world", world_size)
    check_fn("spawn_world", fn)
    check_may_die("spawn_world", may_die, world_size)
    check_timeout("spawn_world", "timeout", timeout)
    if backend_timeout is not None:
        check_timeout("spawn_world", "backend_timeout", backend_timeout)
    if may_die and backend != "gloo":
        raise ArgumentError(
            f"spawn_world: may_die={list(may_die)} needs backend='gloo' (mpiexec ends the job)"
        )
    ref = _fn_reference(fn)
    spec = {"fn": ref, "args": args, "kwargs": kwargs, "backend": backend, "timeout": backend_timeout}
    spec["world_timeout"] = timeout
    spec["check_collectives"] = bool(check_collectives)
    try:
        return _spawn_once(world_size, spec, set(may_die))
    except RankFailedError as exc:
        if backend != "gloo" or "address already in use" not in str(exc).lower():
            raise
    return _spawn_once(world_size, spec, set(may_die))  # the free port was taken before rank 0 bound it


def _spawn_once(world_size: int, spec: dict[str, Any], may_die: set[int]) -> list[Any]:
    backend, timeout = spec["backend"], spec["world_timeout"]
    job = Path(tempfile.mkdtemp(prefix="dtlab-spawn-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(job / "job.pkl", "wb") as f:
            pickle.dump(spec, f)
        env = _worker_env()
        env[ENV_VAR] = "1" if spec["check_collectives"] else "0"
        if backend == "gloo":
            from dtlab.backends.init import _free_port

            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
            for r in range(world_size):
                log = open(job / f"log-{r}.txt", "wb")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _WORKER, str(job)],
                        env={
                            **env,
                            "RANK": str(r),
                            "LOCAL_RANK": str(r),
                            "DTLAB_SPAWN_PARENT": str(os.getpid()),
                        },
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                log.close()
        else:
            log = open(job / "log-mpiexec.txt", "wb")
            cmd = [find_mpiexec(), "-n", str(world_size), sys.executable, "-c", _WORKER, str(job)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        return _collect(job, procs, world_size, backend, timeout, may_die)
    finally:
        _kill_all(job, procs)
        shutil.rmtree(job, ignore_errors=True)


def _read(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _log_tail(job: Path, rank: int | None, size: int = 3000) -> str:
    name = f"log-{rank}.txt" if rank is not None else "log-mpiexec.txt"
    p = job / name
    if not p.exists():
        return ""
    text = p.read_bytes()[-size:].decode(errors="replace").strip()
    return f"\n--- {name} (last {size} bytes) ---\n{text}" if text else ""


def _collect(
    job: Path,
    procs: list[subprocess.Popen[bytes]],
    world_size: int,
    backend: str,
    timeout: float,
    may_die: set[int],
) -> list[Any]:
    deadline = time.monotonic() + timeout

    def missing() -> list[int]:
        return [r for r in range(world_size) if r not in may_die and not (job / f"result-{r}.pkl").exists()]

    while True:
        codes = [p.poll() for p in procs]
        # a process that reported its result and then failed in teardown (gloo aborts now and then
        # while closing sockets) is not a failure of the world; neither are the ranks in may_die
        reported = set(range(world_size)) - set(missing()) - may_die
        finished = (
            reported if backend == "gloo" else ({0} if len(reported) + len(may_die) == world_size else set())
        )
        died = [(i, c) for i, c in enumerate(codes) if c not in (None, 0) and i not in may_die | finished]
        if died:
            time.sleep(0.2)  # a failed rank's report may still be on its way
        errors = sorted(job.glob("error-*.pkl"))
        if errors:  # report the rank that failed first
            rank, _, text = min((_read(p) for p in errors), key=lambda e: e[1])
            raise RankFailedError(rank, f"rank {rank} failed ({backend} world of {world_size}):\n{text}")
        if died:
            i, code = died[0]
            lacking = missing()
            rank = i if backend == "gloo" else _mpi_dead_rank(job, lacking)
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            who = "its process" if backend == "gloo" else f"mpiexec (ranks without a result: {lacking})"
            raise RankFailedError(
                rank,
                f"rank {rank} of a {backend} world of {world_size} died without reporting: {who} ended with "
                f"{how}" + _log_tail(job, rank if backend == "gloo" else None),
            )
        if all(c == 0 or (c is not None and i in may_die | finished) for i, c in enumerate(codes)):
            lacking = missing()
            if lacking:
                raise RankFailedError(
                    lacking[0], f"ranks {lacking} exited without a result" + _log_tail(job, None)
                )
            done = [job / f"result-{r}.pkl" for r in range(world_size)]
            return [_read(p) if p.exists() else None for p in done]
        if time.monotonic() > deadline:
            lacking = missing()
            pids = _worker_pids(job)
            for pid in pids.values():  # each hung rank prints its Python stack to its log
                os.kill(pid, signal.SIGUSR1)
            _wait_for_stacks(job, backend, list(pids), until=time.monotonic() + 10)  # returns once written
            logs = "".join(_log_tail(job, r, 1500) for r in (lacking if backend == "gloo" else [None]))
            raise CollectiveTimeoutError(
                f"spawn_world: the {backend} world of {world_size} did not finish within {timeout:g}s; ranks "
                f"{lacking} had no result (all its processes were killed)"
                + _returned(world_size, lacking)
                + logs,
                tuple(lacking),
                "spawn_world",
            )
        time.sleep(0.02)


def _returned(world_size: int, lacking: list[int]) -> str:
    """What a world timeout with some ranks returned most often is: uneven inputs."""
    returned = sorted(set(range(world_size)) - set(lacking))
    if not returned:
        return ""
    return (
        f"; ranks {returned} had returned: where ranks {lacking} wait in a collective the returned ranks "
        "never called (one more step or batch on some ranks: uneven inputs), it never ends (stacks below)"
    )


def _wait_for_stacks(job: Path, backend: str, ranks: list[int], until: float) -> None:
    logs = [job / f"log-{r}.txt" for r in ranks] if backend == "gloo" else [job / "log-mpiexec.txt"]
    while time.monotonic() < until:
        texts = [p.read_bytes() if p.exists() else b"" for p in logs]
        if all(t.count(b"most recent call first") >= (len(ranks) if backend == "mpi" else 1) for t in texts):
            return
        time.sleep(0.05)


def _worker_pids(job: Path) -> dict[int, int]:
    """``{rank: pid}`` of this world's ranks that are still running (checked by their command line)."""
    pids = {}
    for f in job.glob("pid-*"):
        try:
            pid = int(f.read_text())
            if str(job).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids[int(f.name.split("-")[1])] = pid
        except (OSError, ValueError):
            continue
    return pids


def _mpi_dead_rank(job: Path, lacking: list[int]) -> int:
    """The rank whose PID the MPI launcher reports as terminated (else the first without a result)."""
    pids = {}
    for f in job.glob("pid-*"):
        try:
            pids[int(f.read_text())] = int(f.name.split("-")[1])
        except ValueError:
            continue
    log = job / "log-mpiexec.txt"
    text = log.read_text(errors="replace") if log.exists() else ""
    for m in re.finditer(r"PID (\d+)", text):
        if int(m.group(1)) in pids:
            return pids[int(m.group(1))]
    return lacking[0] if lacking else 0


def _kill_all(job: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every process this world started, by PID; mpiexec first gets SIGTERM to clean up."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for pid in _worker_pids(job).values():  # MPI ranks are children of mpiexec: make sure none is left
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _die_with_parent() -> None:
    """Linux: this rank is killed when the process that started it ends (spawn_world's process for
    gloo, MPI's proxy for mpi), so a benchmark or test killed by a signal leaves no rank behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    expected = os.environ.get("DTLAB_SPAWN_PARENT")
    if expected is not None and os.getppid() != int(expected):  # the parent ended before prctl
        os._exit(1)


def _worker_main() -> None:
    """Body of one spawned rank (``python -c _WORKER <job dir>``)."""
    import faulthandler
    import importlib
    import importlib.util

    import torch

    faulthandler.enable()  # a crash in an engine leaves its stack in the rank's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # spawn_world's timeout asks for stacks
    _die_with_parent()
    torch.set_num_threads(1)
    job = Path(sys.argv[1])
    spec = _read(job / "job.pkl")
    rank = int(
        os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0
    )
    (job / f"pid-{rank}").write_text(str(os.getpid()))
    mpi = spec["backend"] == "mpi"
    try:
        from dtlab.backends.init import init_backend

        timeout = spec["timeout"] if mpi else (spec["timeout"] or spec["world_timeout"])
        backend = init_backend(spec["backend"], timeout=timeout)
        module, qualname, path = spec["fn"]
        if path is not None:
            loader = importlib.util.spec_from_file_location("__dtlab_spawned_main__", path)
            if loader is None or loader.loader is None:
                raise ImportError(f"cannot load {path}")
            mod = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
        fn: Any = mod
        for part in qualname.split("."):
            fn = getattr(fn, part)
        result = fn(backend, *spec["args"], **spec["kwargs"])
        _write(job / f"result-{rank}.pkl", result)
    except BaseException as exc:
        _write(
            job / f"error-{rank}.pkl",
            (rank, time.time(), f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"),
        )
        sys.stdout.flush()
        sys.stderr.flush()
        if mpi:  # bring the whole MPI job down instead of leaving peers blocked in a collective
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        os._exit(1)
    if not mpi:
        backend.close()
    # the work is done: the interpreter's last full collection would walk every object importing torch
    # made (none of them garbage), 1 to 2 CPU-seconds per rank that spawn_world waits for
    gc.freeze()
