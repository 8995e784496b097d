"""The one interface every layer above talks to: :class:`CommunicationBackend`.

Public methods validate their arguments, call the engine (the ``_``-prefixed hooks a concrete
backend implements, declared in ``_engine.py``) and record what this rank sent and received in
:attr:`CommunicationBackend.stats`. Validation and byte accounting live in the interface, once, so
every engine reports the same numbers for the same call. This file holds the collectives; the other
parts of the interface are their own files: argument checks (``_checks.py``), checked mode
(``_checked.py``), point-to-point (``_p2p.py``), object exchange (``_objects.py``) and sub-groups
(``_groups.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import NoReturn, SupportsIndex

import torch

from dtlab.backends._checked import CallChecks, CheckState, checks_from_env
from dtlab.backends._checks import _AVG, _SUPPORTED, ArgumentChecks
from dtlab.backends._groups import GroupMaking, split_members
from dtlab.backends._objects import ObjectExchange
from dtlab.backends._p2p import PointToPoint
from dtlab.backends.stats import CommStats
from dtlab.backends.types import SUPPORTED_DTYPES, CompletedWork, P2POp, ReduceOp, Work
from dtlab.errors import ArgumentError, ArgumentTypeError, StrategyError

__all__ = [
    "SUPPORTED_DTYPES",
    "CommunicationBackend",
    "CompletedWork",
    "P2POp",
    "ReduceOp",
    "Work",
    "check_backend",
    "split_members",
]


class CommunicationBackend(
    ArgumentChecks, CallChecks, ObjectExchange, GroupMaking["CommunicationBackend"], PointToPoint
):
    """Collectives, point-to-point and object exchange among ``world_size`` ranks.

    Vocabulary and in-place contracts follow ``torch.distributed``. Byte counters follow the ring
    convention (see ``docs/backends.md``): with ``P`` ranks and ``n`` bytes, ``all_reduce`` sends and
    receives ``2(P-1)/P * n``; ``reduce_scatter`` and ``all_gather`` ``(P-1)/P`` of the full buffer;
    ``broadcast``/``reduce`` run along a chain starting (ending) at the root; point-to-point counts
    the message.
    """

    #: True for an engine that compares every call itself (the in-memory world): checked mode is a no-op
    _checks_calls_itself: bool = False

    def __init__(self, rank: int, world_size: int, stats_parent: CommStats | None = None) -> None:
        if world_size < 1:
            raise ArgumentError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")
        self._rank = rank
        self._world_size = world_size
        self._stats = CommStats(parent=stats_parent)
        self._checked = not self._checks_calls_itself and checks_from_env()
        self._check_state: CheckState | None = None  # made at the first checked collective
        # the hot collectives test the common case in one inline expression and call the checks only
        # when it fails; an engine that adds checks of its own (NCCL: CUDA tensors only) always gets them
        cls = type(self)
        self._inline_checks = all(
            getattr(cls, name) is getattr(CommunicationBackend, name)
            for name in ("_check_tensor", "_check_op", "_check_reduce_scatter", "_check_all_gather")
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """A backend is this rank's link to the others: ``copy.deepcopy`` or pickling (``torch.save``)
        of an object holding one is refused, naming the values to copy instead."""
        raise StrategyError(
            f"{type(self).__name__} (rank {self.rank} of {self.world_size}) cannot be copied or pickled: "
            "copy.deepcopy, AveragedModel or torch.save reached it through an object holding it (a module "
            "a strategy rebuilt: ZeRO-3/FSDP units, tensor-parallel layers; a Mesh). Copy the values, not "
            "the model: model.state_dict() (every rank calls it) gives the whole tensors; an EMA of them: "
            "ema[k].lerp_(v, 1 - decay) for k, v in model.state_dict().items() after each step "
            "(docs/porting.md, 'EMA / SWA / copying a wrapped model')"
        )

    # ------------------------------------------------------------------ identity (rank etc.: _engine.py)
    @property
    def stats(self) -> CommStats:
        """Per kind of operation: calls, bytes sent and bytes received by this rank."""
        return self._stats

    @property
    def check_collectives(self) -> bool:
        """Checked mode: before each collective the ranks compare what they call (kind, shape, dtype,
        op, root; one all-gather of 16 ints each) and a difference raises ``CollectiveMismatchError``
        on every rank. Default: ``DTLAB_CHECK_COLLECTIVES``; groups inherit their parent's setting."""
        return self._checked or self._checks_calls_itself

    @check_collectives.setter
    def check_collectives(self, on: bool) -> None:
        self._checked = bool(on) and not self._checks_calls_itself

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{self.name}(rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` over all ranks, in place, on every rank."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype in _SUPPORTED
            and tensor.is_contiguous()
            and op.__class__ is ReduceOp
            and (op is not _AVG or tensor.is_floating_point())
        ):
            self._check_tensor(tensor, "all_reduce")
            self._check_op(tensor, op, "all_reduce")
        if self._checked:
            self._agree(("all_reduce", tensor.shape, tensor.dtype, op))
        t0 = perf_counter()
        self._all_reduce(tensor, op)
        dt = perf_counter() - t0
        p = self._world_size
        moved = 2 * (p - 1) * tensor.nbytes // p
        self._stats.record("all_reduce", moved, moved, dt)

    # ------------------------------------------------------------------ non-blocking collectives
    def iall_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Non-blocking ``all_reduce``; ``tensor`` holds the result once ``wait()`` returns.

        Engines that cannot overlap (in-memory) complete it before returning. Bytes are counted at
        the call; ``stats`` seconds measure the call, not the wait.
        """
        self._check_tensor(tensor, "iall_reduce")
        self._check_op(tensor, op, "iall_reduce")
        if self._checked:
            self._agree(("all_reduce", tensor.shape, tensor.dtype, op))
        t0 = perf_counter()
        work = self._iall_reduce(tensor, op)
        dt = perf_counter() - t0
        p, n = self.world_size, tensor.nbytes
        moved = 2 * (p - 1) * n // p
        self._stats.record("all_reduce", moved, moved, dt)
        return work

    def ireduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Non-blocking ``reduce_scatter`` (same contract); complete it with ``wait()``."""
        self._check_reduce_scatter(output, input, op)
        if self._checked:
            self._agree(("reduce_scatter", output.numel(), output.dtype, op))
        t0 = perf_counter()
        work = self._ireduce_scatter(output, input, op)
        dt = perf_counter() - t0
        moved = (self.world_size - 1) * output.nbytes
        self._stats.record("reduce_scatter", moved, moved, dt)
        return work

    def iall_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Non-blocking ``all_gather`` (same contract); complete it with ``wait()``."""
        self._check_all_gather(output, input)
        if self._checked:
            self._agree(("all_gather", input.numel(), input.dtype))
        t0 = perf_counter()
        work = self._iall_gather(output, input)
        dt = perf_counter() - t0
        moved = (self.world_size - 1) * input.nbytes
        self._stats.record("all_gather", moved, moved, dt)
        return work

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` over all ranks into rank ``dst``'s tensor; others keep theirs."""
        self._check_tensor(tensor, "reduce")
        dst = self._check_root(dst, "reduce", "dst")
        self._check_op(tensor, op, "reduce")
        if self._checked:
            self._agree(("reduce", tensor.shape, tensor.dtype, op, dst))
        t0 = perf_counter()
        self._reduce(tensor, dst, op)
        dt = perf_counter() - t0
        # chain (dst+1) -> (dst+2) -> ... -> dst: everyone but dst sends, everyone but the start receives
        p, n = self.world_size, tensor.nbytes
        start = (dst + 1) % p
        sent = n if (p > 1 and self.rank != dst) else 0
        received = n if (p > 1 and self.rank != start) else 0
        self._stats.record("reduce", sent, received, dt)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        self._check_tensor(tensor, "broadcast")
        src = self._check_root(src, "broadcast", "src")
        if self._checked:
            self._agree(("broadcast", tensor.shape, tensor.dtype, src))
        t0 = perf_counter()
        self._broadcast(tensor, src)
        dt = perf_counter() - t0
        # chain src -> src+1 -> ... -> src-1: everyone but the last sends, everyone but src receives
        p, n = self.world_size, tensor.nbytes
        last = (src - 1) % p
        sent = n if (p > 1 and self.rank != last) else 0
        received = n if (p > 1 and self.rank != src) else 0
        self._stats.record("broadcast", sent, received, dt)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """``input`` holds ``world_size * output.numel()`` elements; rank r gets the reduced r-th chunk."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(output, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and output.dtype is input.dtype
            and output.dtype in _SUPPORTED
            and output.is_contiguous()
            and input.is_contiguous()
            and input.numel() == self._world_size * output.numel()
            and op.__class__ is ReduceOp
            and (op is not _AVG or output.is_floating_point())
        ):
            self._check_reduce_scatter(output, input, op)
        if self._checked:
            self._agree(("reduce_scatter", output.numel(), output.dtype, op))
        t0 = perf_counter()
        self._reduce_scatter(output, input, op)
        dt = perf_counter() - t0
        moved = (self._world_size - 1) * output.nbytes
        self._stats.record("reduce_scatter", moved, moved, dt)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` receives ``world_size * input.numel()`` elements: every rank's input in rank order."""
        if not (  # the common case in one expression; the checks below name what is wrong
            self._inline_checks
            and isinstance(output, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and output.dtype is input.dtype
            and output.dtype in _SUPPORTED
            and output.is_contiguous()
            and input.is_contiguous()
            and output.numel() == self._world_size * input.numel()
        ):
            self._check_all_gather(output, input)
        if self._checked:
            self._agree(("all_gather", input.numel(), input.dtype))
        t0 = perf_counter()
        self._all_gather(output, input)
        dt = perf_counter() - t0
        moved = (self._world_size - 1) * input.nbytes
        self._stats.record("all_gather", moved, moved, dt)

    def all_gather_v(self, input: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Variable-sized all-gather: each rank contributes ``input.numel()`` elements (may differ).

        Returns the flat concatenation of every rank's input in rank order and the per-rank counts.
        All ranks must pass the same dtype.
        """
        self._check_tensor(input, "all_gather_v", "input")
        if self._checked:
            self._agree(("all_gather_v", input.dtype))
        t0 = perf_counter()
        output, counts = self._all_gather_v(input.reshape(-1))
        dt = perf_counter() - t0
        sent, received = self._all_gather_v_bytes(counts, input.element_size())
        self._stats.record("all_gather_v", sent, received, dt)
        return output, counts

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        """``inputs[j]`` goes to rank j; ``outputs[i]`` receives what rank i sent to this rank."""
        p = self.world_size
        if len(outputs) != p or len(inputs) != p:
            raise ArgumentError(
                f"all_to_all needs world_size={p} output and input tensors, got "
                f"{len(outputs)} outputs and {len(inputs)} inputs"
            )
        dtypes = {t.dtype for t in list(outputs) + list(inputs)}
        if len(dtypes) > 1:
            raise ArgumentError(
                f"all_to_all: all tensors must share one dtype, got {sorted(map(str, dtypes))}"
            )
        for i, t in enumerate(inputs):
            self._check_tensor(t, "all_to_all", f"inputs[{i}]")
        for i, t in enumerate(outputs):
            self._check_tensor(t, "all_to_all", f"outputs[{i}]")
        if self._checked:
            self._agree(("all_to_all", inputs[0].dtype))
        t0 = perf_counter()
        self._all_to_all(list(outputs), list(inputs))
        dt = perf_counter() - t0
        me = self.rank
        sent = sum(t.nbytes for j, t in enumerate(inputs) if j != me)
        received = sum(t.nbytes for i, t in enumerate(outputs) if i != me)
        self._stats.record("all_to_all", sent, received, dt)

    def barrier(self) -> None:
        """Wait until every rank reaches the barrier."""
        if self._checked:
            self._agree(("barrier",))
        t0 = perf_counter()
        self._barrier()
        dt = perf_counter() - t0
        self._stats.record("barrier", 0, 0, dt)

    def close(self) -> None:
        """Release engine resources (optional)."""


def check_backend(backend: object, who: str) -> None:
    """Refuses, before anything reads it, a ``backend`` given to ``who`` that is not a backend (a
    ``"gloo"`` string, a Mesh where a group goes, a torch process group)."""
    if not isinstance(backend, CommunicationBackend):
        raise ArgumentTypeError(
            f"{who} needs a dtlab CommunicationBackend, got {type(backend).__name__}: pass "
            "init_backend() (under torchrun or mpiexec), the backend run_world gives each rank, or a "
            "mesh's group (mesh['dp'])"
        )
