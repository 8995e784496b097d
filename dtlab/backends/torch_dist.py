"""``GlooBackend`` and ``NCCLBackend``: the interface over ``torch.distributed`` process groups.

One implementation serves both engines; they differ in where tensors live (gloo: CPU, NCCL: CUDA,
checked before any call reaches the engine) and in what the engine offers (NCCL has no any-source
receive and ignores tags). ``ReduceOp.AVG`` is SUM followed by a division (gloo has no AVG).

Timeouts: the process group's timeout (``timeout`` seconds, given at start-up) bounds every
operation. A gloo operation that times out, or whose peer process died (its connection closes),
raises :class:`CollectiveTimeoutError` naming the operation. NCCL's watchdog aborts the process on a
timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); torchrun then ends the job with a non-zero exit code.
"""

from __future__ import annotations

import datetime
from typing import ClassVar, NoReturn

import torch
import torch.distributed as dist

import dtlab.backends._torch_dist_p2p as p2p
from dtlab.backends._checked import mismatch_hint
from dtlab.backends._engine import finish_reduction
from dtlab.backends._peers import gone_peers, publish_identity
from dtlab.backends._run_args import check_timeout
from dtlab.backends._torch_dist_support import (
    _OPS,
    _PEER_LOST,
    _all_gather_flat,
    _create_group,
    _direct_calls,
    _DistWork,
    _flat,
    _reduce_scatter_flat,
    _wait_direct,
    import_default_group_binders,
    to_global,
)
from dtlab.backends.base import CommunicationBackend, P2POp, ReduceOp, Work, split_members
from dtlab.backends.stats import CommStats
from dtlab.errors import ArgumentError, BackendInitError, CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["GlooBackend", "NCCLBackend", "TorchDistBackend"]


class TorchDistBackend(CommunicationBackend):
    """One rank of a ``torch.distributed`` process group (the default group unless ``group`` is given).

    ``torch.distributed`` must be initialized (see :meth:`start` or ``init_backend``). ``timeout`` is
    the group's operation timeout in seconds (reported in errors; set at start-up).
    """

    engine: ClassVar[str] = ""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: str | torch.device = "cpu",
        timeout: float = 300.0,
        stats_parent: CommStats | None = None,
        name: str = "dtlab",
    ) -> None:
        check_timeout(type(self).__name__, "timeout", timeout)  # 300 s unless given: every wait bounded
        if not dist.is_available() or not dist.is_initialized():
            raise BackendInitError(
                f"{type(self).__name__} needs an initialized torch.distributed: use "
                f"dtlab.backends.init_backend('{self.engine}') or {type(self).__name__}.start(...)"
            )
        self._pg = None if group is dist.group.WORLD else group  # None: the default group
        self._closed = False
        super().__init__(dist.get_rank(self._pg), dist.get_world_size(self._pg), stats_parent)
        self._device = torch.device(device)
        self._timeout = float(timeout)
        self._is_world = self._pg is None
        self._name = name  # the group's name in the store, the same on every member
        self._groups_made = 0
        self._direct = _direct_calls(self._pg)

    @classmethod
    def start(
        cls,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        *,
        timeout: float = 300.0,
        device: str | torch.device | None = None,
        init_method: str | None = None,
    ) -> TorchDistBackend:
        """Initialize ``torch.distributed`` and wrap its default group.

        Rendezvous at ``tcp://master_addr:master_port`` (rank 0 hosts the store) unless
        ``init_method`` is given (``"env://"`` under torchrun, whose agent already hosts it).
        """
        if timeout <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        dev = torch.device(device) if device is not None else cls._default_device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # no device_id: a bound device makes torch create sub-groups by ncclCommSplit of the default
        # group, which every process of the job must enter, while dtlab's groups are made by the
        # members of their parent group only (groups of groups)
        import_default_group_binders()  # so that close() ends the default group (and gloo's threads)
        dist.init_process_group(
            cls.engine,
            init_method=init_method or f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        publish_identity()  # so that a peer's death can be named (dtlab/backends/_peers.py)
        return cls(device=dev, timeout=timeout)

    @classmethod
    def _default_device(cls) -> torch.device:
        return torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The underlying ``torch.distributed`` process group (None: the default group)."""
        return self._group

    @property
    def _group(self) -> dist.ProcessGroup | None:
        if self._closed:  # its process group is destroyed and dropped: nothing to run on
            raise BackendInitError(
                f"{self!r} is closed: close() destroyed its process group; make a new group "
                "(new_group/split of an open backend) or start a new backend"
            )
        return self._pg

    @property
    def timeout(self) -> float:
        return self._timeout

    def raise_failure(self, exc: RuntimeError, what: str) -> NoReturn:
        """Turn the engine's timeout / lost-peer error into :class:`CollectiveTimeoutError`."""
        text = str(exc)
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            why = (
                f"did not complete within the {self._timeout:g}s timeout (a peer is hung or did not call it)"
            )
        elif any(k in low for k in _PEER_LOST):
            gone = gone_peers(self._group)
            why = f"lost its connection to a peer (a peer process died{': ' + gone if gone else ''})"
        else:
            raise exc
        raise CollectiveTimeoutError(
            f"rank {self.rank}: {self.engine} {what} {why}{mismatch_hint(self._checked)}: {text}",
            operation=what,
        ) from exc

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        d = self._direct
        try:
            if d is not None:
                _wait_direct(d.all_reduce([tensor], d.ar_opts[op]))
            else:
                dist.all_reduce(tensor, _OPS[op], group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "all_reduce")
        if op is ReduceOp.AVG:
            tensor.div_(self.world_size)

    def _iall_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        work = dist.all_reduce(tensor, _OPS[op], group=self._group, async_op=True)
        p = self.world_size

        def finish() -> None:
            tensor.div_(p)

        return _DistWork(self, work, "all_reduce", finish if op is ReduceOp.AVG else None)

    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        # torch.distributed may overwrite a non-root's tensor with partial results: reduce a copy there
        buf = tensor if self.rank == dst else tensor.clone()
        try:
            dist.reduce(buf, to_global(self._group, dst), _OPS[op], group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "reduce")
        if op is ReduceOp.AVG and self.rank == dst:
            tensor.div_(self.world_size)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        try:
            dist.broadcast(tensor, to_global(self._group, src), group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "broadcast")

    def _rs_output(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        aliased = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        return torch.empty_like(output) if aliased else output

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        out = self._rs_output(output, input)
        d = self._direct
        try:
            if d is not None:
                _wait_direct(d.reduce_scatter(_flat(out), _flat(input), d.rs_opts[op]))
            else:
                _reduce_scatter_flat(_flat(out), _flat(input), _OPS[op], group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "reduce_scatter")
        finish_reduction(out, output, op, self.world_size)

    def _ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        out = self._rs_output(output, input)
        work = _reduce_scatter_flat(_flat(out), _flat(input), _OPS[op], group=self._group, async_op=True)
        p = self.world_size
        return _DistWork(self, work, "reduce_scatter", lambda: finish_reduction(out, output, op, p))

    def _ag_input(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """``input`` itself, or a copy when it overlaps ``output`` other than as this rank's chunk."""
        if output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr():
            return input
        in_place = input.data_ptr() == output.data_ptr() + self.rank * input.numel() * input.element_size()
        return input if in_place else input.clone()

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        d = self._direct
        try:
            if d is not None:
                _wait_direct(d.all_gather(_flat(output), _flat(self._ag_input(output, input)), d.ag_opts))
            else:
                _all_gather_flat(_flat(output), _flat(self._ag_input(output, input)), group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "all_gather")

    def _iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        inp = self._ag_input(output, input)
        work = _all_gather_flat(_flat(output), _flat(inp), group=self._group, async_op=True)
        return _DistWork(self, work, "all_gather")

    def _all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        p, dev = self.world_size, self._device
        counts = torch.zeros(p, dtype=torch.int64, device=dev)
        mine = torch.tensor([input.numel()], dtype=torch.int64, device=dev)
        try:
            _all_gather_flat(counts, mine, group=self._group)
            sizes = [int(c) for c in counts.tolist()]
            most = max(sizes)
            padded = torch.empty(p * most, dtype=input.dtype, device=dev)  # engines need equal sizes
            send = torch.zeros(most, dtype=input.dtype, device=dev)
            send[: input.numel()] = input
            _all_gather_flat(padded, send, group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "all_gather_v")
        parts = [padded[r * most : r * most + sizes[r]] for r in range(p)]
        return torch.cat(parts), sizes

    def _all_gather_v_bytes(self, counts: list[int], element_size: int) -> tuple[int, int]:
        # gloo/NCCL have no variable-sized all-gather: every rank sends max(counts) elements (padded)
        moved = (self.world_size - 1) * (max(counts) * element_size + 8)
        return moved, moved

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        p, me, dev = self.world_size, self.rank, self._device
        send_n = torch.tensor([t.numel() for t in inputs], dtype=torch.int64, device=dev)
        sent_to_me = torch.empty(p, dtype=torch.int64, device=dev)
        try:
            dist.all_to_all_single(sent_to_me, send_n, group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "all_to_all(counts)")
        got = [int(x) for x in sent_to_me.tolist()]
        errors = [
            f"rank {j} sends {got[j]} elements but outputs[{j}] has {outputs[j].numel()}"
            for j in range(p)
            if got[j] != outputs[j].numel()
        ]
        if errors:
            raise CollectiveMismatchError(f"all_to_all on rank {me}: " + "; ".join(errors))
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = torch.empty(sum(got), dtype=send.dtype, device=dev)
        try:
            dist.all_to_all_single(recv, send, got, [t.numel() for t in inputs], group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "all_to_all")
        offset = 0
        for out in outputs:
            out.view(-1).copy_(recv[offset : offset + out.numel()])
            offset += out.numel()

    def _barrier(self) -> None:
        try:
            dist.barrier(group=self._group)
        except RuntimeError as exc:
            self.raise_failure(exc, "barrier")

    # ------------------------------------------------------------------ point-to-point (_torch_dist_p2p.py)
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        p2p.send(self, tensor, dst, tag)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        return p2p.recv(self, tensor, src, tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return p2p.isend(self, tensor, dst, tag)

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        return p2p.irecv(self, tensor, src, tag)

    def _batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        return p2p.batch_isend_irecv(self, ops)

    # ------------------------------------------------------------------ groups
    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None:
        self._groups_made += 1
        name = f"{self._name}.{self._groups_made}"  # same on every member: they call in the same order
        return self._subgroup(ranks, name) if self.rank in ranks else None

    def _split(self, color: int | None, key: int) -> CommunicationBackend | None:
        # one exchange of the pairs; then each rank creates its own color's group with its members
        # (the group's name, the same on every member, keeps groups of one split apart in the store)
        pairs, _ = self._all_gather_object((color, key))
        self._groups_made += 1
        if color is None:
            return None
        return self._subgroup(split_members(pairs, color), f"{self._name}.{self._groups_made}c{color}")

    def _subgroup(self, members: list[int], name: str) -> TorchDistBackend:
        """This rank's backend in a new process group of ``members`` (ranks of this group, in order)."""
        timeout = datetime.timedelta(seconds=self._timeout)
        group = _create_group([to_global(self._group, r) for r in members], name, timeout)
        return type(self)(
            group, device=self._device, timeout=self._timeout, stats_parent=self.stats, name=name
        )

    def close(self) -> None:
        """Destroy this backend's process group (the default group: ``destroy_process_group()``).

        Collective: every rank of the group calls it. A barrier first, so that no rank tears its
        connections down while a peer still uses them (gloo aborts the process then). A second call
        does nothing.
        """
        if self._closed:
            return
        if dist.is_initialized():  # else the default group's close() destroyed every group already
            try:
                dist.barrier(group=self._pg)
            except RuntimeError:  # a peer is gone already: nothing left to wait for
                pass
            dist.destroy_process_group(None if self._is_world else self._pg)
        # drop this backend's handles to the process group too (the direct calls' bound methods, a
        # sub-group itself), so that it is destroyed here, with gloo's worker threads joined, and not
        # during the interpreter's teardown, where a worker that still releases a finished work's
        # tensors needs the GIL and aborts the process; a closed backend's operations raise
        self._closed = True
        self._direct = None
        self._pg = None


class GlooBackend(TorchDistBackend):
    """``torch.distributed`` with gloo: CPU tensors, any-source receive, tags; for CPU clusters."""

    engine: ClassVar[str] = "gloo"


class NCCLBackend(TorchDistBackend):
    """``torch.distributed`` with NCCL: CUDA tensors only; no any-source receive; tags are ignored."""

    engine: ClassVar[str] = "nccl"

    @classmethod
    def _default_device(cls) -> torch.device:
        if not torch.cuda.is_available():
            raise BackendInitError("NCCLBackend needs CUDA, but torch.cuda.is_available() is False; use gloo")
        return torch.device("cuda", torch.cuda.current_device())

    def _check_tensor(self, t: object, op: str, name: str = "tensor") -> None:
        super()._check_tensor(t, op, name)
        if isinstance(t, torch.Tensor) and t.device.type != "cuda":
            raise ArgumentError(
                f"NCCLBackend.{op}: {name} is on {t.device}, but NCCL moves CUDA tensors only; move it "
                f"with .to(backend.device) ({self.device}) or use GlooBackend/MPIBackend for CPU tensors"
            )

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        if src is None:
            raise ArgumentError(self._no_any_source("recv"))
        return super()._recv(tensor, src, tag)

    def _irecv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        if src is None:
            raise ArgumentError(self._no_any_source("irecv"))
        return super()._irecv(tensor, src, tag)

    def _no_any_source(self, op: str) -> str:
        return (
            f"NCCLBackend.{op}: src=None (any source) is not supported by NCCL; pass the source rank, "
            "or exchange this message over a GlooBackend/MPIBackend"
        )
