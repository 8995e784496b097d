"""AsyncSGDOptimizer: parameter servers and workers under bounded staleness (Stale Synchronous Parallel).

The first ``num_servers`` ranks are parameter servers; each owns a balanced shard of the flat
trainable parameters and the torch optimizer state for it. The other ``W`` ranks are workers with a
full replica (``opt.module``). A worker's ``step()`` pushes its gradient shards to the servers and
pulls fresh parameters; its clock is the number of steps it has pushed. Semantics (Ho et al., 2013):

* a worker at clock ``t`` may read (and so compute) only when ``t - slowest <= staleness``, where
  ``slowest`` is the smallest clock of the workers that have not finished; otherwise it blocks;
* ``staleness >= 1`` or ``None``: a server applies each pushed gradient on arrival as ``g / W`` (one
  optimizer step per push), so a read at clock ``t`` sees every update of clocks ``<= t - s - 1``,
  and maybe more (whatever had arrived);
* ``staleness=0``: a server sums the gradients of clock ``t`` and applies their mean once, when every
  worker has pushed clock ``t``; a read at clock ``t + 1`` sees exactly the updates of clocks ``<= t``:
  synchronous data parallelism on the global batch of all workers (any torch optimizer).

Messages travel point-to-point through the backend (see ``_async_comm``); every receive is bounded
by the backend's timeout, and a server or worker that dies or hangs is named in the error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.errors import CollectiveTimeoutError, StrategyError
from dtlab.models.dp.flat import FlatUnit, check_real
from dtlab.optimizers._async_checks import check_agreement, check_arguments, trainable
from dtlab.optimizers._async_comm import (
    ABORT,
    FINISH,
    PUSH,
    READY,
    TAG_NOTE,
    TAG_PARAMS,
    TAG_PUSH,
    Note,
    PushMessage,
    behind,
    bounded,
    pieces_of,
    recv_from_server,
)
from dtlab.optimizers._async_groups import assign_groups
from dtlab.optimizers._async_server import ShardServer
from dtlab.optimizers._backward_watch import BackwardWatch

__all__ = ["AsyncSGDOptimizer"]


class AsyncSGDOptimizer:
    """``AsyncSGDOptimizer(module, backend, torch.optim.SGD, lr=0.1, staleness=2, num_servers=1)``.

    Every rank builds it (a collective: the ranks check they agree on the model and the settings,
    and every worker gets the servers' parameters as its clock-0 read). Then on a worker
    (``not opt.is_server``): ``loss.backward(); opt.step()`` per batch and ``opt.finish()`` at the end;
    on a server: ``opt.serve()`` until every worker has finished. Then ``opt.full_state_dict()`` on
    every rank. ``max_grad_norm`` (staleness 0 only): the servers clip each clock's mean gradient by
    its global norm, as ``torch.nn.utils.clip_grad_norm_`` clips the global batch's on one process.
    ``param_groups``: torch's, over the module's trainable parameters (each in exactly one group).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: CommunicationBackend,
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        staleness: int | None = 0,
        num_servers: int = 1,
        max_grad_norm: float | None = None,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        **optimizer_kwargs: Any,  # Any: optimizer_cls's own keywords
    ) -> None:
        named = trainable(module, backend)
        group_of, options = assign_groups(named, param_groups)
        groups = [{**optimizer_kwargs, **o} for o in options]
        check_arguments(
            backend, optimizer_cls, staleness, num_servers, optimizer_kwargs, max_grad_norm, groups
        )
        if not named:
            raise StrategyError("AsyncSGDOptimizer: the module has no trainable parameters")
        check_real("AsyncSGDOptimizer", named)
        self.module = module
        self.backend = backend
        self.staleness = None if staleness is None else int(staleness)
        self.num_servers = num_servers = int(num_servers)
        self.num_workers = backend.world_size - num_servers
        self.is_server = backend.rank < num_servers
        self._unit = FlatUnit("async_sgd", named, num_servers, min(backend.rank, num_servers - 1))
        self._param_names = [n for n, _ in named]
        first = {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
        self._aliases = {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
        c = self._unit.shard_numel
        settings = (
            self._unit.numel,
            str(self._unit.dtype),
            num_servers,
            staleness,
            max_grad_norm,
            group_of,
            repr(groups),
        )
        check_agreement(backend, module, (self._param_names, *settings))
        self._server: ShardServer | None = None
        self._watch: BackwardWatch | None = None  # a worker's: refuses partial gradients (a raised backward)
        self._finished = False
        self._set_to_none = True  # how step() clears the pushed gradients: as the last zero_grad()
        self._clock = 0
        self.pushes = self.pulls = self.waits = 0
        self.blocked_s = 0.0
        self.max_staleness = 0
        # staleness 0 with max_grad_norm: the servers sum their shards' squared norms (a collective)
        servers = backend.new_group(list(range(num_servers))) if max_grad_norm and num_servers > 1 else None
        flat = self._unit.new_flat()
        self._unit.copy_params_into(flat)
        numels = [p.numel() for _, p in named]
        self._pieces = [pieces_of(numels, c, k) for k in range(num_servers)]
        if self.is_server:
            shard = flat[backend.rank * c : (backend.rank + 1) * c]
            spans = [(o, n, group_of[i]) for i, o, n in self._pieces[backend.rank]]
            self._server = ShardServer(
                backend,
                backend.rank,
                num_servers,
                shard,
                spans,
                optimizer_cls,
                optimizer_kwargs,
                staleness,
                options,
            )
            self._server.clip = max_grad_norm, servers  # staleness 0 only (checked)
            self._unit.unbind()  # a server holds its shard only; the module keeps the layout
        else:
            self._flat = flat
            self._unit.bind(flat)  # the replica's parameters are views into the pulled buffer
            self._flat_grad = self._unit.new_flat()
            self._messages = [
                PushMessage(c, self._unit.dtype, backend.device, len(self._pieces[k]))
                for k in range(num_servers)
            ]
            self._note = Note(self.num_workers, backend.device)
            self._watch = BackwardWatch(
                module, [p for _, p in named], f"AsyncSGDOptimizer worker rank {backend.rank}"
            )
        self._share_parameters()  # the clock-0 read
        self._bytes0 = _p2p_bytes(backend)

    def _share_parameters(self) -> None:
        """Collective: every worker's replica gets every server's shard (a broadcast per server)."""
        c = self._unit.shard_numel
        for k in range(self.num_servers):
            if self._server is not None:
                part = (
                    self._server.param.detach().clone()
                    if k == self.backend.rank
                    else torch.empty_like(self._server.param)
                )
            else:
                part = self._flat[k * c : (k + 1) * c]
            self.backend.broadcast(part, k)

    # ------------------------------------------------------------------ roles
    @property
    def clock(self) -> int:
        """A worker's clock: the number of gradients it has pushed (a server: updates applied)."""
        return self._server.updates if self._server is not None else self._clock

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """A server's torch optimizer over its shard (LR schedules attach to it; see ``serve``)."""
        if self._server is None:
            raise StrategyError(
                f"AsyncSGDOptimizer: rank {self.backend.rank} is a worker; the torch optimizer and its "
                f"state live on the servers (ranks 0..{self.num_servers - 1})"
            )
        return self._server.optimizer

    def _require(self, server: bool, what: str) -> None:
        if self.is_server != server:
            role, other = ("a server", "workers") if self.is_server else ("a worker", "servers")
            raise StrategyError(
                f"AsyncSGDOptimizer.{what}() is for {other}, but rank {self.backend.rank} is {role} "
                f"(ranks 0..{self.num_servers - 1} serve: branch on opt.is_server)"
            )

    # ------------------------------------------------------------------ worker
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the replica's gradients (``step()`` also clears them after pushing); after a backward
        that raised partway, this drops its partial gradients (the bad batch is skipped)."""
        self.module.zero_grad(set_to_none=set_to_none)
        self._set_to_none = set_to_none
        if self._watch is not None:
            self._watch.forget()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Push this worker's gradients and pull parameters for the next clock (``closure``, if given,
        runs first under grad mode: the forward and backward; its loss is returned). A parameter whose
        ``.grad`` is None is flagged so: the servers skip it where no push of the step had one (as
        torch's optimizer skips it)."""
        self._require(False, "step")
        loss = None
        if closure is not None and not self._finished:
            with torch.enable_grad():
                loss = closure()
        if self._finished:
            raise StrategyError(
                f"AsyncSGDOptimizer: worker rank {self.backend.rank} called step() after finish()"
            )
        if self._watch is not None:  # a worker's (checked above): partial gradients are never pushed
            self._watch.check("step()")
        self._unit.grads_into(self._flat_grad)
        had = [p.grad is not None for p in self._unit.params]
        c = self._unit.shard_numel
        sends: list[Work] = []
        for k, msg in enumerate(self._messages):
            msg.set(PUSH, self._clock)
            msg.flags.copy_(torch.tensor([had[i] for i, _, _ in self._pieces[k]], dtype=torch.uint8))
            msg.payload.copy_(self._flat_grad[k * c : (k + 1) * c])
            sends.append(self.backend.isend(msg.buffer, k, TAG_PUSH))
        # these gradients belong to parameters about to be replaced: cleared as the last zero_grad() did
        # (zeroed after zero_grad(set_to_none=False): a used parameter is then stepped on, as in torch)
        self.zero_grad(self._set_to_none)
        self.pushes += 1
        self._clock += 1
        self._pull()
        for work in sends:  # every server has answered, so it has received them
            work.wait()
        return loss

    def finish(self) -> None:
        """Tell every server this worker is done (it no longer holds the others back)."""
        self._require(False, "finish")
        if self._finished:
            return
        sends = []
        for k, msg in enumerate(self._messages):
            msg.set(FINISH, self._clock)
            sends.append(self.backend.isend(msg.buffer, k, TAG_PUSH))
        for work in sends:
            work.wait()
        self._finished = True

    def _pull(self) -> None:
        t0 = perf_counter()
        c = self._unit.shard_numel
        for k in range(self.num_servers):
            held: list[int] | None = None
            while True:
                recv_from_server(
                    self.backend, self._note.tensor, k, TAG_NOTE, held, self._clock, self.staleness
                )
                if self._note.clock != self._clock:
                    raise StrategyError(
                        f"AsyncSGDOptimizer worker rank {self.backend.rank}: server rank {k} answered clock "
                        f"{self._note.clock}, expected {self._clock} (a rank runs another program?)"
                    )
                if self._note.kind == READY:
                    break
                if self._note.kind == ABORT:
                    named = [self.num_servers + i for i, flag in enumerate(self._note.pushed()) if flag]
                    raise CollectiveTimeoutError(
                        f"AsyncSGDOptimizer worker rank {self.backend.rank}: server rank {k} heard nothing "
                        f"within {bounded(self.backend)}; it names worker rank(s) {named}, which neither "
                        "pushed nor finished: they are dead or hung",
                        tuple(named),
                        "AsyncSGDOptimizer.step",
                    )
                self.waits += 1
                held = behind(self._note.pushed(), self._clock, self.staleness or 0, self.num_servers)
            self.max_staleness = max(self.max_staleness, self._clock - self._note.slowest)
            recv_from_server(
                self.backend,
                self._flat[k * c : (k + 1) * c],
                k,
                TAG_PARAMS,
                None,
                self._clock,
                self.staleness,
            )
        self.pulls += 1
        self.blocked_s += perf_counter() - t0

    # ------------------------------------------------------------------ server
    def serve(self, on_update: Callable[[AsyncSGDOptimizer], None] | None = None) -> None:
        """Apply the workers' pushes and answer their pulls until every worker has finished.

        ``on_update(opt)`` runs after each optimizer step of this server (to step an LR scheduler on
        ``opt.optimizer`` or save ``opt.state_dict()`` now and then).
        """
        self._require(True, "serve")
        if self._server is None:  # _require(True) guarantees it; a broken invariant is named, not asserted
            raise StrategyError(f"rank {self.backend.rank}: serve() found no server state")
        hook = None if on_update is None else (lambda: on_update(self))
        self._server.serve(hook)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A server: its parameter shard, its optimizer state and clocks; a worker: its role only
        (its replica is whatever it pulls)."""
        meta = {
            "role": "server" if self.is_server else "worker",
            "rank": self.backend.rank,
            "num_servers": self.num_servers,
            "numel": self._unit.numel,
        }
        if self._server is None:
            return {**meta, "clock": self._clock}
        return {**meta, **self._server.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Collective, on every rank before ``serve()``/``step()``: a server restores its shard and
        optimizer state from its own ``state_dict()``; a worker passes its own ``state_dict()`` or
        None. Then every worker reads the restored parameters as its clock-0 read."""
        role = "server" if self.is_server else "worker"
        if state is not None or self.is_server:
            got = state or {}
            layout = (got.get("role"), got.get("num_servers"), got.get("numel"))
            if layout != (role, self.num_servers, self._unit.numel):
                raise StrategyError(
                    f"AsyncSGDOptimizer rank {self.backend.rank} ({role} of {self.num_servers} servers, "
                    f"{self._unit.numel} parameters) cannot load a state saved by a {layout[0]} of "
                    f"{layout[1]} servers with {layout[2]} parameters; load each rank's own saved state"
                )
        started = self._server.served if self._server is not None else self.pushes > 0
        if started:
            raise StrategyError(
                f"AsyncSGDOptimizer.load_state_dict() on rank {self.backend.rank} must come before serve() "
                "and step(): it sets the parameters every worker starts from"
            )
        if self._server is not None and state is not None:
            self._server.load_state_dict(state)
        self._share_parameters()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (a collective, after ``serve()``/``finish()``):
        parameters from the servers' shards; buffers and frozen parameters from the first worker.
        It is also loaded into ``opt.module`` on every rank (a server's module holds no parameter
        values while serving)."""
        if not self.is_server and not self._finished:
            raise StrategyError(
                f"AsyncSGDOptimizer.full_state_dict(): worker rank {self.backend.rank} must call finish() "
                "first (the servers serve until every worker has finished)"
            )
        c = self._unit.shard_numel
        flat = self._unit.new_flat()
        for k in range(self.num_servers):
            part = flat[k * c : (k + 1) * c]
            if self._server is not None and k == self.backend.rank:
                part.copy_(self._server.param.detach())
            self.backend.broadcast(part, k)
        params = {s.name: flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in self._unit.slots}
        out: dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict().items():
            if self._aliases.get(name) in params:  # a tied parameter is one entry of the flat buffer
                out[name] = params[self._aliases[name]]
                continue
            held = value.detach().clone().contiguous()
            self.backend.broadcast(held, self.num_servers)
            out[name] = held
        if self._server is not None:
            self._unit.bind(flat)  # a server's module gets parameter values again
        else:
            self._flat.copy_(flat)
        self.module.load_state_dict(out)
        return out

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        """Pushes, pulls, waits (pulls held back by the bound), ``blocked_s`` (a worker: time waiting
        for parameters; a server: time waiting for messages), ``max_staleness`` (the largest lead of
        a read over the slowest worker), ``updates`` and the point-to-point bytes since construction."""
        sent, received = _p2p_bytes(self.backend)
        src = self._server if self._server is not None else self
        out = {
            "role": "server" if self.is_server else "worker",
            "rank": self.backend.rank,
            "pushes": src.pushes,
            "pulls": src.pulls,
            "waits": src.waits,
            "blocked_s": src.blocked_s,
            "max_staleness": src.max_staleness,
            "bytes_sent": sent - self._bytes0[0],
            "bytes_received": received - self._bytes0[1],
        }
        out["updates" if self._server is not None else "clock"] = self.clock
        return out


def _p2p_bytes(backend: CommunicationBackend) -> tuple[int, int]:
    return backend.stats["send"].bytes_sent, backend.stats["recv"].bytes_received
