"""Helpers of :mod:`dtlab.backends.torch_dist`: op tables, rank translation, work handles, direct
process-group calls and group creation with dtlab's own unique names."""

from __future__ import annotations

import datetime
from typing import Any, ClassVar, NoReturn, Protocol, cast

import torch
import torch.distributed as dist

from dtlab.backends.base import ReduceOp, Work

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
# torch >= 2.12 names the flat-tensor collectives *_single (the *_tensor names are deprecated)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_PEER_LOST = ("connection closed", "connection reset", "connection refused", "broken pipe")


def to_global(group: dist.ProcessGroup | None, rank: int) -> int:
    """The job's global rank of ``group``'s rank ``rank`` (None: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def to_local(group: dist.ProcessGroup | None, global_rank: int) -> int:
    """``group``'s rank of the job's global rank ``global_rank`` (None: the default group)."""
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def import_default_group_binders() -> None:
    """Import, before ``init_process_group``, the torch module that binds the default group at import.

    ``torch.distributed.nn.functional`` declares its collectives with ``group=group.WORLD`` defaults,
    evaluated when the module is first imported. Building a ``torch.optim`` optimizer imports it
    (through ``torch._dynamo``), after the group exists: those defaults then hold the default process
    group past ``destroy_process_group``, and gloo's worker threads with it, until the interpreter's
    teardown. A worker that releases a finished work's tensors then needs the GIL, which a finalizing
    interpreter refuses by ending the thread inside C++ code: the process aborts ("terminate called
    without an active exception"). Imported first, the defaults are None, and ``close`` ends the group
    and joins its threads while the interpreter is alive.
    """
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # pragma: no cover - a torch build without it: nothing binds the group
        pass


# with dtlab, before a script's own dist.init_process_group can run (a GlooBackend wrapping the group
# it made), not only before the backend's own (docs/backends.md)
import_default_group_binders()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-d view: gloo's flat collectives need matching 1-d buffers (a 0-d one crashes it)."""
    return t if t.dim() == 1 else t.view(-1)


class Failures(Protocol):
    """How an engine error is reported (a :class:`~dtlab.backends.torch_dist.TorchDistBackend` does
    it): a timeout or a lost peer as :class:`~dtlab.errors.CollectiveTimeoutError` naming ``what``."""

    def raise_failure(self, exc: RuntimeError, what: str) -> NoReturn: ...


class _DistWork(Work):
    polls: ClassVar[bool] = True

    def __init__(self, backend: Failures, work: Any, what: str, finish: Any = None) -> None:
        self._backend, self._work, self._what, self._finish = backend, work, what, finish
        self._done = False
        self._result: int | None = None

    def wait(self) -> int | None:
        if not self._done:
            try:
                self._work.wait()
            except RuntimeError as exc:
                self._backend.raise_failure(exc, self._what)
            if self._finish is not None:
                self._result = self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


class _BatchWork:
    """The handles of one coalesced batch, waited together (what ``_DistWork`` wraps for each op)."""

    def __init__(self, works: list[Any]) -> None:
        self._works, self._done = works, False

    def wait(self) -> None:
        if not self._done:
            for w in self._works:
                w.wait()
            self._done = True


def _create_group(members: list[int], name: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of the global ranks ``members`` (in that order), created by the members only.

    ``dist.new_group`` either needs every process of the job (impossible for a group of a group) or,
    with ``use_local_synchronization``, names the group by a hash of its ranks, so a second group of
    the same ranks reuses the first one's store keys and hangs. Here the name is dtlab's own (parent
    name + counter), unique per creation; it goes through torch's group helper. Should that private
    helper change, ``dist.new_group(use_local_synchronization=True)`` is used instead (then the same
    rank list must not be grouped twice).
    """
    from torch.distributed import distributed_c10d as c10d

    me = dist.get_rank()
    try:
        pg, _ = c10d._new_process_group_helper(  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
            len(members),
            members.index(me),
            members,
            dist.get_backend(),
            c10d._get_default_store(),  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
            c10d.GroupName(name),
            timeout=timeout,
        )
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
        return cast(dist.ProcessGroup, pg)
    except (AttributeError, TypeError):  # pragma: no cover - another torch version
        group = dist.new_group(members, timeout=timeout, use_local_synchronization=True, sort_ranks=False)
        return cast(dist.ProcessGroup, group)


class _Direct:
    """The process group's own methods for the three hot collectives (blocking), with options made once.

    ``dist.all_reduce`` and friends re-check their arguments, look up the default group, consult the
    coalescing state and pass through logging decorators: about 15 us per call on a CPU, as much as a
    small gloo all-reduce. dtlab has checked the arguments already and calls the group directly.
    """

    def __init__(self, pg: Any) -> None:
        from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions

        self.all_reduce = pg.allreduce
        self.reduce_scatter = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
        self.all_gather = getattr(pg, "all_gather_single", None) or pg._allgather_base  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
        self.ar_opts: dict[ReduceOp, Any] = {}
        self.rs_opts: dict[ReduceOp, Any] = {}
        for op, engine_op in _OPS.items():
            self.ar_opts[op], self.rs_opts[op] = AllreduceOptions(), ReduceScatterOptions()
            self.ar_opts[op].reduceOp = self.rs_opts[op].reduceOp = engine_op
        self.ag_opts = AllgatherOptions()
        for o in (*self.ar_opts.values(), *self.rs_opts.values(), self.ag_opts):
            if hasattr(o, "asyncOp"):
                o.asyncOp = False  # blocking semantics, as torch.distributed's own blocking calls


def _wait_direct(work: Any) -> None:
    """Complete a direct call's handle (None: the group ran it to completion already)."""
    if work is not None:
        work.wait()


def _direct_calls(group: dist.ProcessGroup | None) -> _Direct | None:
    from torch.distributed import distributed_c10d as c10d

    try:
        return _Direct(group if group is not None else c10d._get_default_group())  # noqa: SLF001 - torch.distributed's own group machinery (no public API for it)
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - another torch version
        return None
