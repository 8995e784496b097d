"""Activations and their gradients between pipeline stages: the schedule's p2p actions posted as batches.

The communication actions a rank meets between two computes are posted together with one
:meth:`~dtlab.backends.base.CommunicationBackend.batch_isend_irecv` (the sends of the last compute and
the receive of the next), so no engine can deadlock on the order of posting. A receive is waited for
right before the compute that needs it; sends are waited for at the end of the step (the dry run has
checked that every receive gets its send, so waiting then cannot hang). Receive buffers are allocated
from the stage boundary's :class:`TensorSpec`, the same on every rank. Each message has its own tag
(direction, stage, micro-batch), and messages between two ranks are posted in the same order on both
sides (checked by the dry run), which is what NCCL's order matching needs.

Every message travels in its boundary's spec dtype (the meta forward's, outside autocast): under
bf16/fp16 autocast a stage may end in a low-precision op on one rank while its peer allocated the
spec's buffer, so the sender casts (a no-op when they agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtlab.backends.base import CommunicationBackend, P2POp, Work
from dtlab.models.pipeline._schedules import Action, Kind, PipelineSchedule
from dtlab.models.pipeline._split import TensorSpec

__all__ = ["StageLinks", "infer_through_stages"]

_TAG_LIMIT = 1 << 15  # MPI guarantees tags up to 32767


class StageLinks:
    """One step's p2p traffic of this rank along the ``pp`` group.

    ``specs[s]`` is the spec of stage ``s``'s output (= stage ``s + 1``'s input and, as a gradient,
    what flows back from ``s + 1`` to ``s``).
    """

    def __init__(
        self, pp: CommunicationBackend, schedule: PipelineSchedule, specs: Sequence[TensorSpec]
    ) -> None:
        self.pp, self.schedule, self.specs = pp, schedule, list(specs)
        self._pending: list[Action] = []
        self._recvs: dict[tuple[Kind, int, int], tuple[Work, torch.Tensor]] = {}
        self._sends: list[Work] = []

    def _tag(self, a: Action) -> int:
        s = self.schedule
        forward = a.kind in (Kind.SEND_F, Kind.RECV_F)
        stage = (
            (a.stage + 1 if a.kind is Kind.SEND_F else a.stage)
            if forward
            else (a.stage - 1 if a.kind is Kind.SEND_B else a.stage)
        )  # the receiving stage names the message on both sides
        return ((0 if forward else 1) * s.num_stages * s.m + stage * s.m + a.micro) % _TAG_LIMIT

    def add(self, action: Action) -> None:
        """Queue a communication action; it is posted with the others before the next compute."""
        self._pending.append(action)

    def flush(self, outgoing: Callable[[Action], torch.Tensor]) -> None:
        """Post every queued action as one batch; ``outgoing(action)`` gives a send's tensor."""
        if not self._pending:
            return
        ops: list[P2POp] = []
        recv_keys: list[tuple[tuple[Kind, int, int], torch.Tensor]] = []
        device = self.pp.device
        for a in self._pending:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                peer_stage = a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1
                spec = self.specs[a.stage] if a.kind is Kind.SEND_F else self.specs[a.stage - 1]
                out = outgoing(a).to(spec.dtype).contiguous()
                ops.append(P2POp.send(out, self.schedule.rank_of(peer_stage), self._tag(a)))
            else:
                spec = self.specs[a.stage - 1] if a.kind is Kind.RECV_F else self.specs[a.stage]
                peer_stage = a.stage - 1 if a.kind is Kind.RECV_F else a.stage + 1
                buf = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                ops.append(P2POp.recv(buf, self.schedule.rank_of(peer_stage), self._tag(a)))
                recv_keys.append(((a.kind, a.stage, a.micro), buf))
        self._pending = []
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
        final = specs[-1]
        src = schedule.rank_of(n - 1)
        if pp.rank == src:
            if out is None:
                raise RuntimeError(f"pipeline rank {src} ran no last stage")  # unreachable
            result = out.contiguous()
        else:
            result = torch.empty(final.shape, dtype=final.dtype, device=pp.device)
        if pp.world_size > 1:
            pp.broadcast(result, src)
    return result
