"""Activations and their gradients between pipeline stages: the schedule's p2p actions posted as batches.

The communication actions a rank meets between two computes are posted together with one
:meth:`~dtlab.backends.base.CommunicationBackend.batch_isend_irecv` (the sends of the last compute and
the receives due next), so no engine can deadlock on the order of posting. The schedule places each
receive one compute ahead of the compute that needs it, the latest it may be posted; the runtime posts
the later receives earlier still, in order, while their waiting buffers fit in ``RECEIVE_AHEAD_BYTES``
(small messages: every receive of the step in the first batch). Gloo moves a message's bytes only once
its receive is posted (a rendezvous): a receive posted after its send costs a notification round trip
between the two ranks' I/O threads on the critical path, while one posted before lets the sender write
the bytes at once; on a loaded machine that round trip costs more than a small stage's compute.
Receives keep the schedule's order, so the order of the messages between two ranks (NCCL matches by
it) is unchanged, and a receive posted earlier can only complete its message sooner. A receive is
waited for right before the compute that needs it; sends are waited for at the end of the step (the
dry run has checked that every receive gets its send, so waiting then cannot hang). Receive buffers are
allocated from the stage boundary's :class:`TensorSpec`, the same on every rank. Each message has its
own tag (direction, stage, micro-batch).

Every message travels in its boundary's spec dtype (the meta forward's, outside autocast): under
bf16/fp16 autocast a stage may end in a low-precision op on one rank while its peer allocated the
spec's buffer, so the sender casts (a no-op when they agree).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from dtlab.backends.base import CommunicationBackend, P2POp, Work
from dtlab.models.pipeline._schedules import Action, Kind, PipelineSchedule
from dtlab.models.pipeline._split import TensorSpec

__all__ = ["StageLinks", "broadcast_over_pp", "infer_through_stages"]

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
        self._planned: deque[tuple[int, Action, TensorSpec, int]] = deque()
        for a in schedule.actions[pp.rank]:
            if a.kind.is_compute:
                self._sends_at.append([])
            elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                self._sends_at[-1].append(a)
            else:
                spec = self.specs[a.stage - 1] if a.kind is Kind.RECV_F else self.specs[a.stage]
                self._planned.append((len(self._sends_at) - 1, a, spec, spec.nbytes))
        self._waiting = 0  # bytes of posted receive buffers not taken yet
        self._recvs: dict[tuple[Kind, int, int], tuple[Work, torch.Tensor]] = {}
        self._sends: list[Work] = []

    def _tag(self, a: Action) -> int:
        s = self.schedule
        direction, stage, micro = a.message()  # the receiving stage names the message on both sides
        return ((0 if direction == "F" else 1) * s.num_stages * s.m + stage * s.m + micro) % _TAG_LIMIT

    def post(self, j: int, outgoing: Callable[[Action], torch.Tensor]) -> None:
        """Before compute ``j`` (``j`` = the number of computes: after the last): post the sends and
        receives the schedule places here, and later receives in order while their buffers fit in
        ``ahead_bytes``, as one batch; ``outgoing(action)`` gives a send's tensor."""
        ops: list[P2POp] = []
        for a in self._sends_at[j]:
            peer_stage = a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1
            spec = self.specs[a.stage] if a.kind is Kind.SEND_F else self.specs[a.stage - 1]
            out = outgoing(a).to(spec.dtype).contiguous()
            ops.append(P2POp.send(out, self.schedule.rank_of(peer_stage), self._tag(a)))
        recv_keys: list[tuple[tuple[Kind, int, int], torch.Tensor]] = []
        planned = self._planned
        while planned:
            at, a, spec, nbytes = planned[0]
            if at > j and self._waiting + nbytes > self.ahead_bytes:
                break
            planned.popleft()
            peer_stage = a.stage - 1 if a.kind is Kind.RECV_F else a.stage + 1
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.pp.device)
            ops.append(P2POp.recv(buf, self.schedule.rank_of(peer_stage), self._tag(a)))
            recv_keys.append(((a.kind, a.stage, a.micro), buf))
            self._waiting += nbytes
        if not ops:
            return
        works = self.pp.batch_isend_irecv(ops)
        it = iter(recv_keys)
        for op, work in zip(ops, works, strict=True):
            if op.kind == "send":
                self._sends.append(work)
            else:
                key, buf = next(it)
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
        if self._recvs:  # unreachable after a dry-run schedule; say so rather than leave them dangling
            raise RuntimeError(f"pipeline step ended with receives never used: {sorted(self._recvs)}")


def infer_through_stages(
    x: torch.Tensor,
    run_stage: Callable[[torch.Tensor, int], torch.Tensor],
    specs: Sequence[TensorSpec],
    schedule: PipelineSchedule,
    pp: CommunicationBackend,
) -> torch.Tensor:
    """Inference through every stage without autograd: this rank runs its stages (``run_stage(h,
    s)``), activations go to the next stage's rank, and the last stage's output reaches every pp rank.
    Messages are cast to their spec dtype, so autocast on either side cannot mismatch them."""
    n = len(specs)
    out: torch.Tensor | None = None
    with torch.no_grad():
        h = x
        for s in range(n):
            owner = schedule.rank_of(s)
            if owner != pp.rank:
                continue
            if s > 0 and schedule.rank_of(s - 1) != owner:
                h = torch.empty(specs[s - 1].shape, dtype=specs[s - 1].dtype, device=pp.device)
                pp.recv(h, schedule.rank_of(s - 1), tag=s)
            h = run_stage(h, s)
            if s + 1 < n and schedule.rank_of(s + 1) != owner:
                pp.send(h.to(specs[s].dtype).contiguous(), schedule.rank_of(s + 1), tag=s + 1)
            if s + 1 == n:
                out = h.to(specs[s].dtype)
        return broadcast_over_pp(out, specs[-1].shape, specs[-1].dtype, schedule.rank_of(n - 1), pp)


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
