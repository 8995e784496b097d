"""Start a training run on the backend the config names: threads of an in-memory world, or this
process's rank under a launcher (torchrun -> gloo/nccl, mpiexec -> mpi) via ``init_backend``."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, check_world_size
from dtlab.errors import BackendInitError, ConfigError
from dtlab.parallel_config import run_plan
from dtlab.trainers.arguments import check_arguments
from dtlab.trainers.construction import model_init
from dtlab.trainers.custom import task_from_objects
from dtlab.trainers.one_rank import in_background
from dtlab.trainers.preemption import StopRequest
from dtlab.trainers.preflight import check_paths
from dtlab.trainers.scheduler import SchedulerFactory, check_scheduler_factory
from dtlab.trainers.tasks import Task, build_task, check_task
from dtlab.trainers.trainer import Trainer, TrainResult

__all__ = ["launcher_detected", "resolve_backend_name", "run_training", "seed_process"]


def seed_process(seed: int) -> None:
    """Seed this process's torch (every device), Python and NumPy global generators with ``seed``
    (a launched rank's own process; never on an in-memory rank, whose threads share them)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def launcher_detected(env: Mapping[str, str] | None = None) -> bool:
    """True when torchrun or an MPI launcher started this process (``init_backend``'s detection)."""
    from dtlab.backends.init import detect_launcher

    return detect_launcher(env).launcher != "none"


def resolve_backend_name(config: TrainConfig, env: Mapping[str, str] | None = None) -> str:
    """``auto`` becomes ``inmemory`` when no launcher started this process."""
    name = config.backend.name
    if name == "auto" and not launcher_detected(env):
        return "inmemory"
    return name


def _rank_main(
    backend: CommunicationBackend,
    config: TrainConfig,
    task: Task,
    scheduler_factory: SchedulerFactory | None,
    stop: StopRequest | None,
) -> TrainResult:
    trainer = Trainer(config, backend, task=task, scheduler_factory=scheduler_factory, stop=stop)
    result = trainer.fit()
    trainer.close()  # after a clean run only: closing is collective, a failed rank's peers must not wait
    return result


def stopped_at(result: TrainResult, config: TrainConfig) -> str:
    """Where an in-memory run interrupted from the caller stopped: its step, its checkpoint."""
    saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint (checkpoint.dir unset)"
    if result.preempted_by is None:
        return f"training finished all {result.final_step} steps before the stop request was seen; {saved}"
    return (
        f"training stopped by {result.preempted_by} after step {result.final_step} of "
        f"{config.train.steps} (every rank); {saved}"
    )


def run_training(
    config: TrainConfig,
    task: Task | None = None,
    scheduler_factory: SchedulerFactory | None = None,
    stop: StopRequest | None = None,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    train_data: Any = None,
    eval_data: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | str | None = None,
) -> list[TrainResult]:
    """Train; returns every rank's result (in-memory) or this process's (under a launcher).

    Your own model and data: ``model`` (an ``nn.Module``, copied for each in-memory rank, or a
    function building one), ``train_data``/``eval_data`` (map-style torch Datasets of ``(input,
    target)``; without ``eval_data`` the last ``data.eval_fraction`` is held out) and ``loss_fn``
    (``"cross_entropy"``, ``"mse"`` or a function), checked before any rank starts.

    ``stop``: once set (``dtlab train`` sets it on SIGTERM/SIGINT, ``trainers/preemption.py``), every
    rank stops after the same step with a final checkpoint; ``TrainResult.preempted_by`` says why.
    In-memory, a ``KeyboardInterrupt`` (Ctrl-C) while waiting sets it (one is made when none is given):
    the ranks stop after their step, then ``KeyboardInterrupt`` says where (``trainers/one_rank.py``)."""
    check_arguments("run_training", config, task, stop)
    if model is not None or train_data is not None:
        if task is not None:
            raise TypeError("run_training: pass either task or model/train_data/eval_data/loss_fn, not both")
        task = task_from_objects(config, model, train_data, eval_data, loss_fn)
    if scheduler_factory is not None:  # a scheduler instead of a function building one: refused here
        check_scheduler_factory(scheduler_factory)
    model_init(config, run_plan(config))  # model.init=meta where every rank holds the whole model: refused
    name = resolve_backend_name(config)
    if name == "inmemory":
        from dtlab.backends.init import LaunchInfo, detect_launcher
        from dtlab.backends.threads import run_world

        try:
            launch = detect_launcher()
        except BackendInitError:  # incomplete launcher variables: refused if they say several processes
            if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
                raise
            launch = LaunchInfo("none")  # a stray WORLD_SIZE=1: one process, as before the check
        if launch.launcher != "none" and (launch.world_size or 1) > 1:  # N copies of one in-memory run
            engines = "mpi" if launch.launcher == "mpi" else "gloo, nccl"  # torchrun starts no MPI ranks
            launcher = {"mpi": "mpiexec", "slurm": "srun"}.get(launch.launcher, launch.launcher)
            raise ConfigError(
                f"backend.name='inmemory' in a process {launcher} started as rank {launch.rank} of "
                f"{launch.world_size}: each process would train an in-memory world of its own, apart from "
                f"the others; use backend.name=auto (or {engines}) to make the processes one world, "
                "or run without the launcher"
            )
        ws = config.backend.world_size
        check_world_size(config, ws)
        check_paths(config)  # before any rank starts: one ConfigError (the Trainer checks again, per rank)
        task = task or build_task(config)  # read once, shared read-only by the rank threads
        check_task(config, task, ws)  # before any rank starts: one clear error
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
        # Ctrl-C in the caller (a notebook, a script): the ranks stop after their step, as on SIGINT
        stop = StopRequest() if stop is None else stop
        try:
            args = (ws, _rank_main, config, task, scheduler_factory, stop)
            # one rank on a RankThread too (run_world runs one rank on the caller's thread): it draws
            # from a generator of its own, its data seeded, as each of 2+ ranks does, not from
            # whatever state the process's generators were left in
            return in_background(
                lambda: run_world(*args, timeout=config.backend.timeout),
                rank_thread=ws == 1,
                stop=stop,
                grace=config.backend.timeout,
                stopped=lambda results: stopped_at(results[0], config),
            )
        finally:
            torch.set_num_threads(threads)
    ws = config.backend.world_size
    if "world_size" in config.backend.model_fields_set and ws > 1 and not launcher_detected():
        raise ConfigError(
            f"backend.world_size={ws} sizes the in-memory world only; backend.name={name!r} takes its "
            f"ranks from a launcher, and none started this process (it would train alone): run "
            f"`torchrun --nproc-per-node {ws} -m dtlab train ...` (gloo, nccl) or `mpiexec -n {ws} python "
            f"-m dtlab train ...` (mpi), or set backend.name=auto for {ws} in-memory ranks"
        )
    from dtlab.backends import init_backend
    from dtlab.backends.init import choose_backend, detect_launcher

    # MPI: its blocking calls, watched: one that runs backend.timeout seconds ends the job naming it
    # (polling every operation instead cost 1.3x on a small all-reduce, up to 70x oversubscribed);
    # the other engines bound their waits by it. check_collectives unset: DTLAB_CHECK_COLLECTIVES decides
    bound = config.backend.timeout
    engine = choose_backend(detect_launcher()) if name == "auto" else name
    waits = {"timeout": None, "watchdog": bound} if engine == "mpi" else {"timeout": bound}
    backend = init_backend(name, **waits, check_collectives=config.backend.check_collectives or None)
    check_world_size(config, backend.world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // backend.world_size))
    # this process is one rank: its dropout (and a model's own Python or NumPy draws) draw from
    # train.seed (torch, Python and NumPy seed each process at random), the same seed on
    # the ranks of one tp group (tp innermost in the mesh: rank // tp), so they draw the same masks
    # where the model is not split (other masks would give their whole parameters other gradients;
    # where it is split, each tp rank draws from a generator seeded from this stream and its tp
    # rank); each dp replica and pipeline rank its own; + 1: not the seed the initialization draws from.
    # A dataset's draws in __getitem__ do not come from this stream: each sample's are seeded by its
    # place in the epoch (DataFeed, ThreadFetch without a lock here), as on in-memory ranks and in workers
    seed_process(config.train.seed + 1 + backend.rank // config.parallel.tp)
    result = [_rank_main(backend, config, task or build_task(config), scheduler_factory, stop)]
    # closed only after the run: a failing rank does not close (collective: its barrier would keep the
    # process alive, its peers waiting in their next collective for backend.timeout, then blaming a hung
    # peer); once it exits, its connections close and the peers' waits fail at once, naming it as gone
    backend.close()
    return result
