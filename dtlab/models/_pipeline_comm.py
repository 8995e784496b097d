"""Activations and their gradients between pipeline stages: the schedule's p2p actions posted as batches.

The communication actions a rank meets between two computes are posted together with one
:meth:`~dtlab.backends.base.CommunicationBackend.batch_isend_irecv` (the sends of the last compute and
the receive of the next), so no engine can deadlock on the order of posting. A receive is waited for
right before the compute that needs it; sends are waited for at the end of the step (the dry run has
checked that every receive gets its send, so waiting then cannot hang). Receive buffers are allocated
from the stage boundary's :class:`TensorSpec`, the same on every rank. Each message has its own tag
(direction, stage, micro-batch), and messages between two ranks are posted in the same order on both
sides (checked by the dry run), which is what NCCL's order matching needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtlab.backends.base import CommunicationBackend, P2POp, Work
from dtlab.models._pipeline_schedules import Action, Kind, PipelineSchedule
from dtlab.models._pipeline_split import TensorSpec

__all__ = ["StageLinks"]

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
                ops.append(
                    P2POp.send(outgoing(a).contiguous(), self.schedule.rank_of(peer_stage), self._tag(a))
                )
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
