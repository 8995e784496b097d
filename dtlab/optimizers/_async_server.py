"""The parameter-server side of :class:`~dtlab.optimizers.async_sgd.AsyncSGDOptimizer`.

:class:`ClockTable` is the bounded-staleness bookkeeping (no communication): how many clocks each
worker has pushed, who has finished, who waits for parameters. :class:`ShardServer` owns one shard of
the flat parameters and the torch optimizer over it and runs the serve loop: receive a push or a
finish from any worker, apply it, then answer every waiting worker whose read the bound allows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.errors import CollectiveTimeoutError, DtlabError, StrategyError
from dtlab.optimizers._async_comm import (
    ABORT,
    FINISH,
    PUSH,
    READY,
    TAG_NOTE,
    TAG_PARAMS,
    TAG_PUSH,
    WAIT,
    Note,
    PushMessage,
    behind,
    bounded,
)

__all__ = ["ClockTable", "ShardServer"]


class ClockTable:
    """Stale Synchronous Parallel bookkeeping of one server for ``workers`` workers.

    A worker's clock is the number of gradients it has pushed. A read at clock ``t`` is allowed when
    ``t - slowest <= staleness`` where ``slowest`` is the smallest clock of the unfinished workers
    (``staleness=None``: always). Since every push is applied on arrival, such a read sees every
    update of clocks ``<= t - staleness - 1``.
    """

    def __init__(self, workers: int, staleness: int | None) -> None:
        self.staleness = staleness
        self.pushed = [0] * workers
        self.finished = [False] * workers
        self.waiting: dict[int, int] = {}  # worker index -> the clock it wants parameters for

    def unfinished(self) -> list[int]:
        return [i for i, done in enumerate(self.finished) if not done]

    def slowest(self) -> int | None:
        """The smallest clock of the unfinished workers (None: all finished)."""
        return min((self.pushed[i] for i in self.unfinished()), default=None)

    def may_read(self, clock: int) -> bool:
        low = self.slowest()
        return self.staleness is None or low is None or clock - low <= self.staleness

    def counts(self) -> list[int]:
        """Pushed clocks per worker, ``-1`` for the finished ones (as sent in notes)."""
        return [-1 if done else n for n, done in zip(self.pushed, self.finished, strict=True)]

    def push(self, worker: int) -> None:
        self.pushed[worker] += 1
        self.waiting[worker] = self.pushed[worker]

    def finish(self, worker: int) -> None:
        self.finished[worker] = True
        self.waiting.pop(worker, None)


class ShardServer:
    """Server ``index`` of ``num_servers``: elements ``[index*c, (index+1)*c)`` of the flat parameters.

    ``aggregate`` (staleness 0): the gradients of one clock are summed and applied once, as their
    mean over the workers, when every unfinished worker has pushed that clock (one optimizer step per
    clock: synchronous data parallelism). Otherwise each push is applied on arrival as ``g / W``
    (one optimizer step per push).
    """

    def __init__(
        self,
        backend: CommunicationBackend,
        index: int,
        num_servers: int,
        shard: torch.Tensor,
        pieces: list[tuple[int, int, int]],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        staleness: int | None,
        group_options: list[dict[str, Any]] | None = None,
    ) -> None:
        self.backend = backend
        self.index = index
        self.num_servers = num_servers
        self.workers = backend.world_size - num_servers
        self.staleness = staleness
        self.aggregate = staleness == 0
        self.param = shard.detach().clone()
        # one parameter per piece of a model parameter (views of the shard), so that a piece no worker
        # had a gradient for is skipped as torch skips a .grad of None; a shard of padding alone: itself.
        # Each piece in its parameter's group: every server has every group (some maybe empty)
        spans = pieces or [(0, self.param.numel(), 0)]
        self._pieces = [torch.nn.Parameter(self.param[o : o + n]) for o, n, _ in spans]
        groups = [
            {**options, "params": [p for p, (_, _, g) in zip(self._pieces, spans, strict=True) if g == k]}
            for k, options in enumerate(group_options or [{}])
        ]
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        self._grad = torch.zeros_like(self.param)
        self._grads = [self._grad[o : o + n] for o, n, _ in spans]
        self.flags = len(pieces)  # flag bytes in a push: one per piece
        self._used = [False] * len(spans)  # staleness 0: the pieces some push of the clock had a gradient for
        self._had = [False] * len(spans)  # the pieces whose .grad is set (to their view of self._grad)
        self._acc = torch.zeros_like(self.param) if self.aggregate else None
        self._acc_clock: int | None = None
        #: staleness 0: (max_grad_norm, the servers' group or None for one server): the clock's mean
        #: gradient is clipped by its global norm, as torch.nn.utils.clip_grad_norm_ on one process
        self.clip: tuple[float | None, CommunicationBackend | None] = (None, None)
        self.updates = 0
        self.clocks = [0] * self.workers
        self.served = False
        # statistics
        self.pushes = 0
        self.pulls = 0
        self.waits = 0
        self.blocked_s = 0.0
        self.max_staleness = 0

    # ------------------------------------------------------------------ the loop
    def serve(self, on_update: Callable[[], None] | None) -> None:
        if self.served:
            raise StrategyError(
                f"AsyncSGDOptimizer: server rank {self.backend.rank} already served this run; build a "
                "new optimizer (and load_state_dict) for another one"
            )
        self.served = True
        table = ClockTable(self.workers, self.staleness)
        msg = PushMessage(self.param.numel(), self.param.dtype, self.backend.device, self.flags)
        pending: list[list[tuple[Work, torch.Tensor]]] = [[] for _ in range(self.workers)]
        told: dict[int, list[int]] = {}  # the last WAIT note's holders, per waiting worker
        while table.unfinished():
            src = self._receive(msg, table)
            i = src - self.num_servers
            for work, _ in pending[i]:  # it answered our last note: they are delivered
                work.wait()
            pending[i].clear()
            kind, clock = msg.kind, msg.clock
            if kind == PUSH:
                if clock != table.pushed[i]:
                    raise StrategyError(
                        f"AsyncSGDOptimizer server rank {self.backend.rank}: worker rank {src} pushed clock "
                        f"{clock}, expected {table.pushed[i]} (a rank runs another program?)"
                    )
                self.pushes += 1
                self._apply(msg.payload, msg.flags, clock, on_update)
                table.push(i)
            elif kind == FINISH:
                table.finish(i)
                told.pop(i, None)
            else:
                raise StrategyError(
                    f"AsyncSGDOptimizer server rank {self.backend.rank}: unknown message kind {kind} from "
                    f"rank {src} on tag {TAG_PUSH} (another program uses this tag?)"
                )
            if self._acc_clock is not None and self._clock_complete(table, self._acc_clock):
                self._apply_aggregate(on_update)
            self.clocks = list(table.pushed)
            self._answer(table, pending, told)
        for sends in pending:
            for work, _ in sends:
                work.wait()

    def _receive(self, msg: PushMessage, table: ClockTable) -> int:
        t0 = perf_counter()
        try:
            src = self.backend.recv(msg.buffer, None, TAG_PUSH)
        except CollectiveTimeoutError as exc:
            silent = [i for i in table.unfinished() if i not in table.waiting] or table.unfinished()
            ranks = [self.num_servers + i for i in silent]
            self._tell_waiting(table, silent)
            clocks = ", ".join(f"rank {self.num_servers + i} at clock {table.pushed[i]}" for i in silent)
            held = sorted(self.num_servers + i for i in table.waiting)
            raise CollectiveTimeoutError(
                f"AsyncSGDOptimizer server rank {self.backend.rank}: no push or finish from any worker "
                f"within {bounded(self.backend)}; worker rank(s) {ranks} ({clocks}) neither pushed nor "
                "finished"
                + (f" while worker rank(s) {held} wait for parameters" if held else "")
                + f": they are dead or hung ({exc})",
                tuple(ranks),
                "AsyncSGDOptimizer.serve",
            ) from exc
        finally:
            self.blocked_s += perf_counter() - t0
        if not self.num_servers <= src < self.backend.world_size:
            raise StrategyError(
                f"AsyncSGDOptimizer server rank {self.backend.rank}: a message on tag {TAG_PUSH} came from "
                f"rank {src}, which is not a worker (another program uses this tag?)"
            )
        return src

    def _tell_waiting(self, table: ClockTable, silent: list[int]) -> None:
        """Before raising, tell every waiting worker which workers this server names (best effort)."""
        flags = [1 if i in silent else 0 for i in range(self.workers)]
        sends = []
        for i, clock in table.waiting.items():
            note = Note.make(ABORT, clock, -1, flags, self.backend.device)
            try:  # gloo closes every connection after a timeout: then the workers time out themselves
                sends.append((self.backend.isend(note, self.num_servers + i, TAG_NOTE), note))
            except (DtlabError, RuntimeError):
                continue
        for work, _ in sends:
            try:
                work.wait()
            except (DtlabError, RuntimeError):
                continue

    def _answer(
        self, table: ClockTable, pending: list[list[tuple[Work, torch.Tensor]]], told: dict[int, list[int]]
    ) -> None:
        """Send the parameters to every waiting worker the bound lets read; a WAIT note to the others
        whose set of workers they wait for changed."""
        device = self.backend.device
        snapshot: torch.Tensor | None = None
        slowest = table.slowest()
        for i, clock in sorted(table.waiting.items()):
            dst = self.num_servers + i
            low = clock if slowest is None else slowest
            if table.may_read(clock):
                if snapshot is None:  # one copy per round: the sends read it while we go on
                    snapshot = self.param.detach().clone()
                note = Note.make(READY, clock, low, table.counts(), device)
                pending[i].append((self.backend.isend(note, dst, TAG_NOTE), note))
                pending[i].append((self.backend.isend(snapshot, dst, TAG_PARAMS), snapshot))
                self.pulls += 1
                self.max_staleness = max(self.max_staleness, clock - low)
                del table.waiting[i]
                told.pop(i, None)
                continue
            if self.staleness is None:  # may_read is always True without a bound
                raise StrategyError("a worker was held back although staleness=None sets no bound")
            holders = behind(table.counts(), clock, self.staleness, self.num_servers)
            if told.get(i) != holders:
                note = Note.make(WAIT, clock, low, table.counts(), device)
                pending[i].append((self.backend.isend(note, dst, TAG_NOTE), note))
                self.waits += 1
                told[i] = holders

    # ------------------------------------------------------------------ updates
    def _apply(
        self, grad: torch.Tensor, flags: torch.Tensor, clock: int, on_update: Callable[[], None] | None
    ) -> None:
        had = [bool(f) for f in flags.tolist()] if self.flags else [True]
        if self._acc is None:
            self._grad.copy_(grad).div_(self.workers)
            self._step(had, on_update)
            return
        if self._acc_clock is not None and self._acc_clock != clock:
            raise StrategyError(  # cannot happen under staleness 0: every worker waits for the clock
                f"AsyncSGDOptimizer server rank {self.backend.rank}: a clock-{clock} push arrived while "
                f"clock {self._acc_clock} is incomplete"
            )
        self._acc_clock = clock
        self._acc.add_(grad)
        self._used = [a or b for a, b in zip(self._used, had, strict=True)]

    def _clock_complete(self, table: ClockTable, clock: int) -> bool:
        return all(table.pushed[i] > clock for i in table.unfinished())

    def _apply_aggregate(self, on_update: Callable[[], None] | None) -> None:
        if self._acc is None:
            raise StrategyError("staleness=0 aggregation ran without its accumulator")
        self._grad.copy_(self._acc).div_(self.workers)
        self._acc.zero_()
        self._acc_clock = None
        used, self._used = self._used, [False] * len(self._used)
        if self.clip[0] is not None:
            self._clip(used, self.clip[0], self.clip[1])
        self._step(used, on_update)

    def _clip(self, used: list[bool], max_norm: float, servers: CommunicationBackend | None) -> None:
        """torch's clip_grad_norm_ over the pieces with a gradient, the norm summed over the servers."""
        norms = [g.norm() for g, u in zip(self._grads, used, strict=True) if u]
        sq = torch.stack(norms).square().sum() if norms else self._grad.new_zeros(())
        if servers is not None:
            sq = sq.reshape(1)
            servers.all_reduce(sq)
        coef = torch.clamp(max_norm / (sq.sqrt().reshape(()) + 1e-6), max=1.0)
        self._grad.mul_(coef)

    def _step(self, had: list[bool], on_update: Callable[[], None] | None) -> None:
        """One optimizer step on ``self._grad``; a piece no push had a gradient for is skipped."""
        if had != self._had:  # the pieces' .grad (views of self._grad) set again only when `had` changes
            for p, g, h in zip(self._pieces, self._grads, had, strict=True):
                p.grad = g if h else None
            self._had = had
        self.optimizer.step()
        self.updates += 1
        if on_update is not None:
            on_update()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "shard": self.param.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # a snapshot, not live tensors
            "updates": self.updates,
            "clocks": list(self.clocks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shard = state["shard"]
        if not isinstance(shard, torch.Tensor) or shard.shape != self.param.shape:
            got = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            raise StrategyError(
                f"AsyncSGDOptimizer server rank {self.backend.rank}: the saved shard has shape {got}, this "
                f"server holds {tuple(self.param.shape)}; load the state saved by server {self.index} of "
                f"{self.num_servers} of the same model"
            )
        saved = state["optimizer"]
        held = (
            sum(len(g.get("params", ())) for g in saved.get("param_groups", ()))
            if isinstance(saved, dict)
            else -1
        )
        if held != len(self._pieces):
            raise StrategyError(
                f"AsyncSGDOptimizer server rank {self.backend.rank}: the saved optimizer state covers {held} "
                f"tensors, this server steps {len(self._pieces)} (one per parameter piece of its shard); "
                f"load the state saved by server {self.index} of {self.num_servers} of the same model and "
                "dtlab version"
            )
        with torch.no_grad():
            self.param.copy_(shard)
        self.optimizer.load_state_dict(copy.deepcopy(saved))  # torch would adopt its tensors
        self.updates = int(state.get("updates", 0))
