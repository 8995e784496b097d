"""``ElasticOptimizer``: ranks may leave and join between steps; nothing committed is lost.

::

    opt = ElasticOptimizer(ZeRO2Optimizer(model, torch.optim.AdamW, lr=1e-3), commit_every=20)
    commit = opt.restore()                     # collective: the last commit, resharded (None: fresh)
    for step in range(commit.key.step if commit else 0, steps):
        ...; loss.backward(); opt.step(); scheduler.step()
        opt.end_step(step + 1, state=lambda: {"sampler": sampler.state_dict(), ...})

Every ``commit_every`` steps :meth:`end_step` *commits*: each rank encodes its model and optimizer
shards (whatever the inner strategy's ``sharded_state_dict`` holds, compression state included) and
the trainer-level state it is given, keeps that copy and sends it to its ring neighbour (rank ``r`` to
``r + copy_to``, default 1), which keeps it too. Every rank's shards thus live on two ranks, so
losing one rank (or any set of ranks none of which holds another's copy) loses no committed state;
with several ranks per node, ``copy_to`` = ranks per node puts every copy on another node, so a
whole node may be lost. This holds even under
ZeRO-3/FSDP where no other rank holds those shards (Horovod elastic's ``state.commit()`` keeps only
replicated state). The previous commit is dropped once every rank holds the new one.

After a membership change the members of the new world call :meth:`restore`: they pool the commits
they hold, take the newest complete one (every rank of the world that made it covered), send each
shard to every member and load them through the strategies' own resharding
(``load_sharded_state_dict`` reads any world size), then re-commit at once under the new world so the
next failure finds a complete ring. At most ``commit_every`` steps are redone; from the commit on, a
deterministic run computes exactly what an uninterrupted run at the new size computes.

Where commits are held and when the world changes is the :class:`ElasticMember`'s business: the
in-memory engine (``dtlab.testing.elastic.run_elastic``) keeps them in each member thread's memory and
changes the world on a schedule; under torchrun elastic (workers restart as new processes) they are
written to a node-local directory (:class:`DiskCommitStore`). MPI is refused: shrinking a
communicator after a process died needs ULFM, which MPICH's default build lacks.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.checkpoint.agree import agree, read_on_src
from dtlab.errors import CheckpointError, DtlabError, StrategyError, integer
from dtlab.optimizers._elastic_commit import (
    Commit,
    CommitKey,
    CommitStore,
    DiskCommitStore,
    MemoryCommitStore,
    decode_commit,
    encode_commit,
    ring_exchange,
)
from dtlab.optimizers.base import OptimizerStrategy, WrappingStrategy

__all__ = [
    "Commit",
    "CommitKey",
    "CommitStore",
    "DiskCommitStore",
    "ElasticMember",
    "ElasticOptimizer",
    "MemoryCommitStore",
    "StaticMember",
]

StateArg = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


class ElasticMember(Protocol):
    """This rank's place in an elastic job: where its commits are held, what happens at a step end."""

    @property
    def store(self) -> CommitStore: ...

    def step_done(self, step: int, commit: Callable[[], None]) -> None:
        """Called after every step (after any commit of that step). A member that must leave the
        world here raises; before a planned change (a rank joins) it calls ``commit()`` first, so
        nothing is redone."""


class StaticMember:
    """A member whose world never changes from inside the process: a launcher (torchrun) restarts
    the workers itself. It only holds the store."""

    def __init__(self, store: CommitStore | None = None) -> None:
        self._store = store if store is not None else MemoryCommitStore()

    @property
    def store(self) -> CommitStore:
        return self._store

    def step_done(self, step: int, commit: Callable[[], None]) -> None:  # noqa: ARG002 - the commit-policy hook; this policy commits nothing here
        return None


def refuse_mpi(backend: CommunicationBackend) -> None:
    if "mpi" in type(backend).__name__.lower():
        raise StrategyError(
            "ElasticOptimizer does not run on MPI: after a process dies, MPI can only shrink the "
            "communicator with ULFM (MPIX_Comm_shrink), which MPICH's default build (and the mpich "
            "wheel) lacks, so the survivors could not rebuild their world. Use the in-memory backend "
            "or gloo/nccl under torchrun elastic (--nnodes=MIN:MAX), or drop elastic training"
        )


class ElasticOptimizer(WrappingStrategy):
    """Wrap ``inner`` (any optimizer strategy) so its run survives ranks leaving and joining."""

    strategy_name = "elastic"

    def __init__(
        self,
        inner: OptimizerStrategy,
        commit_every: int = 20,
        *,
        member: ElasticMember | None = None,
        copy_to: int = 1,
    ) -> None:
        if not isinstance(inner, OptimizerStrategy):
            raise TypeError(
                "ElasticOptimizer wraps an optimizer strategy such as ZeRO2Optimizer(model, "
                f"torch.optim.AdamW, lr=1e-3), got {type(inner).__name__}"
            )
        if isinstance(inner, ElasticOptimizer):
            raise StrategyError("ElasticOptimizer is already applied; wrap the inner strategy once")
        if integer(commit_every) is None or commit_every < 1:
            raise StrategyError(
                f"commit_every must be an integer >= 1 (steps between commits), got {commit_every!r}; "
                "at most that many steps are redone after a rank is lost"
            )
        if integer(copy_to) is None or copy_to < 1:
            raise StrategyError(
                f"copy_to must be an integer >= 1 (rank r's copy goes to rank r + copy_to), got "
                f"{copy_to!r}; with several ranks per node pass the ranks per node"
            )
        refuse_mpi(inner.model.backend)
        self.inner = inner
        self.model = inner.model
        self.compatible_models = inner.compatible_models  # type: ignore[misc]
        self.commit_every = int(commit_every)
        #: rank r's copy goes to rank r + copy_to (1 if the world is not larger than that)
        self.copy_to = int(copy_to)
        self.member: ElasticMember = member if member is not None else StaticMember()
        #: counts the worlds this job's commits came from (a restore starts the next one)
        self.generation = 0
        #: the key of this rank's newest commit
        self.last_commit: CommitKey | None = None
        #: commits made, seconds and bytes (this rank's encoded shards) of the last one
        self.commit_count = 0
        self.commit_seconds = 0.0
        self.commit_bytes = 0
        #: what the last :meth:`restore` did (``None`` before any)
        self.recovery: dict[str, Any] | None = None
        #: after a restore at the saved world size: this rank's own commit (its state is this rank's)
        self.own_restored: Commit | None = None

    # ------------------------------------------------------------------ delegated
    own_attributes = ("inner", "model", "member")  # the inner strategy's own (statistics, ...): read through

    def own_memory(self) -> dict[str, int]:
        return {"elastic_commits": self.member.store.nbytes()}

    # ------------------------------------------------------------------ commits
    def end_step(self, step: int, state: StateArg = None) -> bool:
        """Call once after every step (the LR scheduler stepped, evaluation done), with the number of
        steps done. Commits when ``step`` is a multiple of ``commit_every``; then lets the member act
        (the in-memory engine's scheduled kills and joins). Returns whether it committed."""
        committed = step % self.commit_every == 0
        if committed:
            self.commit(step, state)

        def commit_now() -> None:
            if not committed:
                self.commit(step, state)

        self.member.step_done(step, commit_now)
        return committed

    def commit(self, step: int, state: StateArg = None) -> CommitKey:
        """Collective: commit this rank's shards and ``state`` as step ``step``, copy them to the ring
        neighbour, and once every rank holds both drop the older commits."""
        t0 = time.perf_counter()
        backend = self.model.backend
        extra = state() if callable(state) else state
        key = CommitKey(int(step), self.generation, backend.world_size, backend.rank)
        own = encode_commit(
            Commit(key, self.model.sharded_state_dict(), self.inner.sharded_state_dict(), dict(extra or {}))
        )
        store = self.member.store
        store.put(own)
        p = backend.world_size
        if p > 1:
            store.put(ring_exchange(backend, own, self.copy_to if self.copy_to < p else 1))
        # every rank holds its own and its neighbour's new commit only once all have returned here
        flag = torch.ones(1, dtype=torch.int32, device=backend.device)
        backend.all_reduce(flag, ReduceOp.SUM)
        store.keep_only(key)  # the older commits (a directory shared by several ranks keeps them all)
        self.last_commit = key
        self.commit_count += 1
        self.commit_bytes = len(own)
        self.commit_seconds = time.perf_counter() - t0
        return key

    # ------------------------------------------------------------------ restore
    def restore(self) -> Commit | None:
        """Collective over the (new) world: load the newest complete commit any member holds into the
        model and the inner strategy, re-commit it under this world, and return it (its ``state`` is
        the trainer-level state given to :meth:`commit`). ``None`` when no member holds a commit."""
        t0 = time.perf_counter()
        backend = self.model.backend
        received0 = backend.stats.bytes_received
        store = self.member.store
        inventories = backend.all_gather_object([tuple(k) for k in store.keys()])
        holders: dict[CommitKey, list[int]] = {}
        for member_rank, keys in enumerate(inventories):
            for k in keys:
                holders.setdefault(CommitKey(*k), []).append(member_rank)
        if not holders:
            return None
        best = _newest_complete(holders)
        commits: list[Commit] = []
        for r in range(best.world_size):
            key = best._replace(rank=r)
            src = min(holders[key])
            # a holder that cannot read its copy tells every rank (no rank waits in the broadcast)
            data = read_on_src(
                backend, src, functools.partial(store.get, key), f"elastic: reading the commit {tuple(key)}"
            )
            commits.append(decode_commit(data))  # the same bytes on every rank: every rank fails alike
        problem = None
        try:
            self.model.load_sharded_state_dict([c.model for c in commits])
            self.inner.load_sharded_state_dict([c.optim for c in commits])
        except DtlabError as exc:
            problem = str(exc)
        agree(backend, problem, f"elastic: restoring the commit of step {best.step}")
        restored = commits[0]
        same = best.world_size == backend.world_size
        self.own_restored = commits[backend.rank] if same else None
        self.generation = best.generation + 1
        self.commit(best.step, (self.own_restored or restored).state)  # each rank's own where it has one
        self.recovery = {
            "step": best.step,
            "from_world_size": best.world_size,
            "world_size": backend.world_size,
            "generation": self.generation,
            "bytes_received": backend.stats.bytes_received - received0,
            "seconds": time.perf_counter() - t0,
        }
        if backend.rank == 0:
            logging.getLogger("dtlab.elastic").info(
                "elastic: restored the commit of step %d (%d ranks) on %d ranks in %.2fs",
                best.step,
                best.world_size,
                backend.world_size,
                self.recovery["seconds"],
            )
        return restored


def _newest_complete(holders: Mapping[CommitKey, list[int]]) -> CommitKey:
    """The rank-0 key of the newest commit whose every rank is held by some member."""
    worlds = sorted({(k.step, k.generation, k.world_size) for k in holders}, reverse=True)
    missing: dict[tuple[int, int, int], list[int]] = {}
    for step, gen, ws in worlds:
        lacking = [r for r in range(ws) if CommitKey(step, gen, ws, r) not in holders]
        if not lacking:
            if missing:
                logging.getLogger("dtlab.elastic").warning(
                    "elastic: the newer commit(s) %s are incomplete (a rank failed while committing); "
                    "restoring step %d",
                    sorted(missing),
                    step,
                )
            return CommitKey(step, gen, ws, 0)
        missing[(step, gen, ws)] = lacking
    (step, gen, ws), lacking = next(iter(missing.items()))
    raise CheckpointError(
        f"elastic: committed state is lost: the commit of step {step} ({ws} ranks, generation {gen}) "
        f"has no surviving copy of rank(s) {lacking}'s shards. Each rank's commit lives on that rank "
        "and on rank + copy_to (its ring neighbour), so losing both loses it; resume from a "
        "checkpoint (checkpoint.dir) instead"
    )
