"""ZeRO-3/FSDP calls that would put the ranks of the data-parallel group out of step or read parked
parameters: forwards of the wrapped module called outside the wrapper (:class:`DirectForwards`), a
module inside a unit called on its own (:class:`InnerCalls`), and ranks that gathered different units
(:func:`same_gathers`).

Each forward gathers the sharded parameters with every rank, matched by order alone, so every rank
must run as many. Hugging Face's ``model.module.generate(...)`` runs until its own prompts are done: a
rank whose prompts reach their end-of-sequence token sooner (or, under ``max_length``, were longer)
stops early, and its next collective (the wrapper's next forward, the state dict's gathers) meets the
others' next gather: a collective mismatch, a hang, or, between units of one size, a silent mix of
their shards. :class:`DirectForwards` has the ranks agree on what they are running (one all-reduce of
two numbers) before each such forward that gathers, and once after them, before the wrapper's next
forward, state dict or whole-model gather: ranks out of step are refused together, naming the fix. A
forward that gathers nothing (inside ``summon_full_params()``, every unit kept whole) communicates
nothing and is not checked.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, StrategyError
from dtlab.models.dp._sharded_units import ShardUnit, UnitGatherer

__all__ = ["DIRECT", "FORWARD", "GATHER", "STATE", "DirectForwards", "InnerCalls", "same_gathers"]

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


def same_gathers(group: CommunicationBackend, trace: int, who: str) -> None:
    """Refuse, on every rank of ``group`` at once, unless every rank's ``trace`` is the same (one
    all-reduce of two float64, before the gradients are reduced, ``find_unused_parameters=True``).

    ``trace`` fingerprints the units this rank gathered (:meth:`UnitGatherer.take_trace`). A gather is
    matched with the other ranks' by order alone, so ranks routing their batches through different
    modules (a branch taken on some ranks, experts chosen per rank) gather different units at the same
    point: with units of equal size the engines do not notice, and every rank computes with a mix of
    the units' shards (silently wrong)."""
    buf = torch.tensor([float(trace), -float(trace)], dtype=torch.float64, device=group.device)
    group.all_reduce(buf, ReduceOp.MAX)
    if float(buf[0]) == -float(buf[1]):
        return
    raise StrategyError(
        f"{who} on rank {group.rank}: the ranks of the data-parallel group gathered different units since "
        "the last synchronized backward: they ran different modules of the model, or in another order "
        "(a branch taken on some ranks only, experts chosen per rank). A gather is collective, so a rank "
        "gathering one unit while another gathers an other of the same size receives a mix of both: "
        "this step's forward and gradients are wrong, and nothing was reduced. Under ZeRO-3/FSDP every "
        "rank must run the same modules in the same order: run every branch on every rank (an expert "
        "without tokens on an empty batch), put the branches in one FSDP unit (a wrap_policy on their "
        "parent), or use DDPModel, ZeRO1Model or ZeRO2Model, whose parameters are whole on every rank"
    )


class InnerCalls:
    """A forward pre-hook on every module of ``module`` that owns parameters of a sharded unit it is not
    the module of (Hugging Face's ``model.get_input_embeddings()(input_ids)`` for ``inputs_embeds=``,
    under FSDP whose unit holding the embedding is the whole model's or a decoder layer's). Only a
    unit's own module gathers it, so between forwards such a module would read its parameters' parked
    stand-ins (NaN, silently): the hook refuses the call then, naming the module, the unit and the
    fixes; with the unit gathered or the tensors swapped (``functional_call``) it lets the call
    through. torch's FSDP2 refuses such a call too (a sharded DTensor parameter)."""

    def __init__(self, at_rest: UnitGatherer, module: nn.Module, who: str) -> None:
        self.at_rest, self.who = at_rest, who
        names = {id(m): n for n, m in module.named_modules()}
        heads = {id(g) for g, _ in at_rest.groups}
        unit_of = {
            id(p): (names.get(id(g), "?"), st)
            for g, sts in at_rest.groups
            for st in sts
            if not st.persistent
            for p in st.unit.params
        }
        for name, m in module.named_modules():
            owned = [unit_of[id(p)] for p in m.parameters(recurse=False) if id(p) in unit_of]
            if id(m) in heads or not owned:
                continue
            hook = partial(self._check, name, owned[0][0], [st for _, st in owned])
            m.register_forward_pre_hook(hook)

    def _check(self, name: str, unit: str, units: list[ShardUnit], module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():  # traced inside the wrapper's forward: gathered, nothing to trace
            return
        if all(st.flat is not None for st in units):  # gathered: the usual case, one check
            return
        parked = {st.unit.marker.untyped_storage().data_ptr() for st in units if st.unit.marker.numel()}
        if not any(p.untyped_storage().data_ptr() in parked for p in module.parameters(recurse=False)):
            return  # its tensors are not the stand-ins (swapped by functional_call: a pipeline's trace)
        torch_class = next((c for c in type(module).__mro__ if c.__module__.startswith("torch.nn")), None)
        base = type(module).__name__ if torch_class is None else f"nn.{torch_class.__name__}"
        where = f"the unit of {unit!r}" if unit else "the wrapped model's own unit"
        raise StrategyError(
            f"{self.who}: {name!r} ({type(module).__name__}) was called on its own, outside the wrapper's "
            f"forward, while its parameters are sharded in {where}, which only that module's forward "
            "gathers: it would read their empty stand-ins (NaN). Make it a unit of its own (add its class "
            f"to the wrap policy: ModuleClassPolicy((..., {base})); dtlab train: strategy.fsdp_units), as "
            "torch FSDP2's fully_shard(module) on it, or use ZeRO-3 (a unit per module); or call it inside "
            "the model's forward (pass input_ids rather than inputs_embeds)"
        )
