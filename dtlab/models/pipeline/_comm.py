"""Activations and their gradients between pipeline stages: the schedule's p2p actions posted as batches.

The communication actions a rank meets between two computes are posted as one
:meth:`~dtlab.backends.base.CommunicationBackend.batch_isend_irecv`, so no engine can deadlock on the
order of posting. Later receives are posted earlier still, in order, while their buffers fit in
:data:`RECEIVE_AHEAD_BYTES`: gloo moves a message's bytes only once its receive is posted, and a
receive posted after its send costs a round trip between the two ranks on the critical path
(docs/strategies.md, "Schedules"). Receives keep the schedule's order, so the order of the messages
between two ranks (NCCL matches by it) is unchanged. A receive is waited for right before the compute
that needs it, sends at the end of the step (the dry run has checked that every receive gets its
send). Each message has its own tag and travels in its boundary's :class:`TensorSpec` dtype (the meta
forward's, outside autocast), cast by the sender, so autocast on either side cannot mismatch it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend, P2POp, Work
from dtlab.models.pipeline._schedules import Action, Kind, PipelineSchedule
from dtlab.models.pipeline._split import TensorSpec, TupleSpec

__all__ = [
    "StageLinks",
    "broadcast_over_pp",
    "counts_over_dp",
    "infer_through_stages",
    "loss_and_counts_over_pp",
]

_TAG_LIMIT = 1 << 15  # MPI guarantees tags up to 32767


#: receive buffers posted ahead of the schedule may hold up to this many bytes at once (at least the
#: receives the schedule places are posted, whatever their size)
RECEIVE_AHEAD_BYTES = 32 << 20


class StageLinks:
    """One step's p2p traffic of this rank along the ``pp`` group, following ``schedule``'s actions.

    ``specs[s]`` is the spec of stage ``s``'s output (= stage ``s + 1``'s input and, as a gradient,
    what flows back from ``s + 1`` to ``s``). Call :meth:`post` before each compute of the rank (its
    index among the rank's computes) and once after the last, then :meth:`finish`.
    """

    def __init__(
        self,
        pp: CommunicationBackend,
        schedule: PipelineSchedule,
        specs: Sequence[TensorSpec],
        ahead_bytes: int = RECEIVE_AHEAD_BYTES,
    ) -> None:
        self.pp, self.schedule, self.specs = pp, schedule, list(specs)
        self.ahead_bytes = ahead_bytes
        # the sends the schedule places right before compute j (the last entry: after the last compute),
        # and every receive in order with the compute before which the schedule places it
        self._sends_at: list[list[Action]] = [[]]
        self._planned: deque[tuple[int, Action]] = deque()
        for a in schedule.actions[pp.rank]:
            if a.kind.is_compute:
                self._sends_at.append([])
            elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                self._sends_at[-1].append(a)
            else:
                self._planned.append((len(self._sends_at) - 1, a))
        self._waiting = 0  # bytes of posted receive buffers not taken yet
        self._recvs: dict[tuple[Kind, int, int], tuple[Work, torch.Tensor]] = {}
        self._sends: list[Work] = []

    def _route(self, a: Action) -> tuple[int, TensorSpec, int]:
        """The peer rank of communication action ``a``, the spec of its message and the message's tag."""
        s = self.schedule
        direction, stage, micro = a.message()  # the receiving stage names the message on both sides
        sender = stage - 1 if direction == "F" else stage + 1
        peer = sender if a.kind in (Kind.RECV_F, Kind.RECV_B) else stage
        tag = ((0 if direction == "F" else 1) * s.num_stages * s.m + stage * s.m + micro) % _TAG_LIMIT
        return s.rank_of(peer), self.specs[min(stage, sender)], tag

    def post(self, j: int, outgoing: Callable[[Action], torch.Tensor]) -> None:
        """Before compute ``j`` (``j`` = the number of computes: after the last): post the sends and
        receives the schedule places here, and later receives in order while their buffers fit in
        ``ahead_bytes``, as one batch; ``outgoing(action)`` gives a send's tensor."""
        ops: list[P2POp] = []
        for a in self._sends_at[j]:
            peer, spec, tag = self._route(a)
            ops.append(P2POp.send(outgoing(a).to(spec.dtype).contiguous(), peer, tag))
        sends = len(ops)
        received: list[tuple[tuple[Kind, int, int], torch.Tensor]] = []
        while self._planned:
            at, a = self._planned[0]
            peer, spec, tag = self._route(a)
            if at > j and self._waiting + spec.nbytes > self.ahead_bytes:
                break
            self._planned.popleft()
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.pp.device)
            ops.append(P2POp.recv(buf, peer, tag))
            received.append(((a.kind, a.stage, a.micro), buf))
            self._waiting += spec.nbytes
        if not ops:
            return
        works = self.pp.batch_isend_irecv(ops)  # in the order of ops: the sends, then the receives
        self._sends += works[:sends]
        for (key, buf), work in zip(received, works[sends:], strict=True):
            self._recvs[key] = (work, buf)

    def take(self, kind: Kind, stage: int, micro: int) -> torch.Tensor:
        """Wait for the receive ``kind`` (``RECV_F``/``RECV_B``) of ``stage``, ``micro`` and return it."""
        work, buf = self._recvs.pop((kind, stage, micro))
        self._waiting -= buf.nbytes
        work.wait()
        return buf

    def finish(self) -> None:
        """Wait for every send of the step."""
        for w in self._sends:
            w.wait()
        self._sends = []


def infer_through_stages(
    x: torch.Tensor,
    run_stage: Callable[[torch.Tensor, int], Any],
    specs: Sequence[TensorSpec],
    schedule: PipelineSchedule,
    pp: CommunicationBackend,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Inference through every stage without autograd: this rank runs its stages (``run_stage(h,
    s)``), activations go to the next stage's rank, and the last stage's output (a tensor, or the tuple
    of tensors of a :class:`TupleSpec`) reaches every pp rank. Messages are cast to their spec dtype, so
    autocast on either side cannot mismatch them."""
    n, me, last = len(specs), pp.rank, specs[-1]
    items = last.items if isinstance(last, TupleSpec) else (last,)
    out: Sequence[torch.Tensor | None] = [None] * len(items)
    with torch.no_grad():
        h = x
        for s in schedule.stages_of(me):  # in stage order
            if s > 0 and schedule.rank_of(s - 1) != me:
                h = torch.empty(specs[s - 1].shape, dtype=specs[s - 1].dtype, device=pp.device)
                pp.recv(h, schedule.rank_of(s - 1), tag=s)
            h = run_stage(h, s)
            if s + 1 < n and schedule.rank_of(s + 1) != me:
                pp.send(h.to(specs[s].dtype).contiguous(), schedule.rank_of(s + 1), tag=s + 1)
            if s + 1 == n:
                got = h if isinstance(last, TupleSpec) else (h,)
                out = [t.to(spec.dtype) for t, spec in zip(got, items, strict=True)]
        src = schedule.rank_of(n - 1)
        whole = [broadcast_over_pp(t, s.shape, s.dtype, src, pp) for t, s in zip(out, items, strict=True)]
        return tuple(whole) if isinstance(last, TupleSpec) else whole[0]


def broadcast_over_pp(
    tensor: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    src: int,
    pp: CommunicationBackend,
) -> torch.Tensor:
    """``tensor`` of pipeline rank ``src`` on every pipeline rank (``tensor`` is ignored elsewhere): the
    loss of the last stage, an inference's output, the whole model's tensors for ``full_state_dict``."""
    if pp.rank == src:
        if tensor is None:
            raise RuntimeError(f"pipeline rank {src} holds no tensor to broadcast")  # unreachable
        out = tensor.detach().contiguous().clone()
    else:
        out = torch.empty(tuple(shape), dtype=dtype, device=pp.device)
    if pp.world_size > 1:
        pp.broadcast(out, src)
    return out


def loss_and_counts_over_pp(
    loss: torch.Tensor | None, count: int, pp: CommunicationBackend, flag: bool
) -> tuple[torch.Tensor, list[int], bool]:
    """The loss of the rank holding it (``loss``, None elsewhere) on every pipeline rank, with every
    rank's ``count`` (indexed by pipeline rank) and whether any rank raised its ``flag``: one all-reduce
    (sum) of ``1 + pp`` float32 values, each rank adding zeros but for its own slot (``x + 0`` is exact:
    the loss arrives bit for bit), a flagged rank's slot holding ``-1 - count``."""
    buf = torch.zeros(1 + pp.world_size, dtype=torch.float32, device=pp.device)
    if loss is not None:
        buf[0] = loss.detach().reshape(())
    buf[1 + pp.rank] = -1 - count if flag else count
    if pp.world_size > 1:
        pp.all_reduce(buf)
    slots = [int(c) for c in buf[1:].tolist()]
    return buf[:1].clone(), [c if c >= 0 else -1 - c for c in slots], any(c < 0 for c in slots)


def counts_over_dp(per_pp_rank: list[int], dp: CommunicationBackend) -> dict[tuple[int, int], int]:
    """Every dp replica's counts (``per_pp_rank``: this replica's, from :func:`loss_and_counts_over_pp`)
    keyed ``(dp rank, pipeline rank)``: one all-reduce (sum) over dp of ``dp x pp`` float32 values, each
    replica adding zeros but for its own ``pp``, so replicas that disagree all learn it."""
    p = len(per_pp_rank)
    values = [0] * (dp.world_size * p)
    values[dp.rank * p : (dp.rank + 1) * p] = per_pp_rank
    buf = torch.tensor(values, dtype=torch.float32, device=dp.device)
    if dp.world_size > 1:
        dp.all_reduce(buf)
    return {divmod(i, p): int(c) for i, c in enumerate(buf.tolist())}
