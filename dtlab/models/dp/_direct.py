"""ZeRO-3/FSDP forwards of the wrapped module called directly, outside the wrapper (Hugging Face's
``model.module.generate(...)``), kept in step across the data-parallel group.

Each such forward gathers the sharded parameters with every rank, matched by order alone, so every rank
must run as many. ``generate()`` runs until its own prompts are done: a rank whose prompts reach their
end-of-sequence token sooner (or, under ``max_length``, were longer) stops early, and its next collective
(the wrapper's next forward, the state dict's gathers) meets the others' next gather: a collective
mismatch, a hang, or, between units of one size, a silent mix of their shards. :class:`DirectForwards`
has the ranks agree on what they are running (one all-reduce of two numbers) before each such forward
that gathers, and once after them, before the wrapper's next forward, state dict or whole-model gather:
ranks out of step are refused together, naming the fix. A forward that gathers nothing (inside
``summon_full_params()``, every unit kept whole) communicates nothing and is not checked.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import ReduceOp
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, StrategyError
from dtlab.models.dp._sharded_units import UnitGatherer

__all__ = ["DIRECT", "FORWARD", "GATHER", "STATE", "DirectForwards"]

DIRECT, FORWARD, STATE, GATHER = 1, 2, 3, 4
_CALLS = {
    DIRECT: "a forward of model.module called outside the wrapper (model.module.generate(...))",
    FORWARD: "the wrapper's forward",
    STATE: "model.state_dict()",
    GATHER: "a gather of the whole model (summon_full_params(), a pipeline step)",
}


class DirectForwards:
    """The agreement of the ranks of ``at_rest``'s group on their calls after direct forwards."""

    def __init__(self, at_rest: UnitGatherer, wrapper: nn.Module, module: nn.Module) -> None:
        self.at_rest = at_rest
        #: a direct forward ran since the last agreement on another call
        self.pending = False
        #: the wrapped module and its first forward pre-hook, which the gather hooks install last
        self.hook = (module, self.before)
        wrapper.register_forward_pre_hook(lambda *_: self.settle(FORWARD), prepend=True)  # before broadcasts

    def before(self, _module: nn.Module, _args: Any) -> None:
        """The wrapped module's first forward pre-hook: a forward outside the wrapper (not busy) without
        gradients that will gather a unit agrees first."""
        at = self.at_rest
        if at.busy or torch.is_grad_enabled() or all(st.flat is not None for st in at.units):
            return
        self.pending = False  # refused on every rank: the next call agrees with the others again
        self._agree(DIRECT)
        self.pending = True

    def settle(self, call: int) -> None:
        """Before ``call`` (one of the codes above): agree once after direct forwards."""
        if self.pending:
            self.pending = False
            self._agree(call)

    def _agree(self, call: int) -> None:
        group = self.at_rest.group
        buf = torch.tensor([float(call), -float(call)], dtype=torch.float64, device=group.device)
        try:
            work = group.iall_reduce(buf, ReduceOp.MAX)
            wait_s = self.at_rest.forward_wait_s
            deadline = time.monotonic() + wait_s
            polls = 0
            while work.polls and not work.is_completed():  # Gloo, NCCL: a rank that left is named
                if wait_s and time.monotonic() > deadline:
                    raise StrategyError(self._message(call, None, f"waited {wait_s:g} s for the others"))
                polls += 1
                if polls > 1000:  # spin first: this runs before every decoding step of generate()
                    time.sleep(0.0005)
            work.wait()
        except (CollectiveMismatchError, CollectiveTimeoutError) as exc:  # in memory: named at once
            raise StrategyError(self._message(call, None, str(exc))) from exc
        high, low = int(buf[0]), -int(buf[1])
        if high != low:
            raise StrategyError(self._message(call, high if high != call else low, ""))

    def _message(self, call: int, other: int | None, seen: str) -> str:
        at = self.at_rest
        found = (
            f"this rank is in {_CALLS[call]} while another is in {_CALLS[other]}"
            if other is not None
            else f"in {_CALLS[call]} the other ranks did not join ({seen})"
        )
        return (
            f"{at.who} on rank {at.group.rank}: the ranks of the data-parallel group are out of step: "
            f"{found}. Each forward of model.module outside the wrapper gathers the sharded parameters "
            "with every rank, so every rank must run as many, together; generate() stops on each rank when "
            "its own prompts are done (an end-of-sequence token reached sooner, or max_length with prompts "
            "of other lengths), and a rank generating alone (if rank == 0: ...) runs them by itself. "
            "Generate inside with model.summon_full_params(writeback=False): model.module.generate(...) on "
            "every rank (each holds the whole model for the block, its forwards communicating nothing; "
            "on a tensor-parallel composition: model.dp_strategy.summon_full_params(...)), or "
            "the same number of tokens on every rank (max_new_tokens=n, min_new_tokens=n), or pass "
            "synced_gpus=True (Hugging Face keeps a finished rank's forwards going; it needs "
            "torch.distributed's default group, which the Gloo and NCCL engines set up); to generate on "
            "one rank only, load state = model.state_dict() (called on every rank) into a plain model there"
        )
