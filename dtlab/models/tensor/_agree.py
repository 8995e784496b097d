"""Every rank of a tensor-parallel group must be given the same batch: the ranks compute one model
together, each on its slice of the layers, so a batch that differs between them (data sharded by the
global rank, torch DDP's habit) mixes their activations in every all-reduce and lets the replicated
parameters drift apart, silently. :func:`check_same_on_tp` refuses it on every rank of the group:
one all-reduce of each rank's three-integer fingerprint (a digest of the inputs' structure and two
exact checksums of their bits, :func:`_checksums`); only when they differ do the ranks exchange
descriptions of their inputs, to name who differs from tp rank 0, and in what. :class:`SameOnTp` makes
it at the calls a :class:`~dtlab.core.plan.TpBatchCheck` asks for. How and its limits:
docs/strategies.md, "Every tp rank gets the same batch". A pipeline checks its pp ranks' batches with
the same function (``axis="pp"``) at its first step and inference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.core.plan import TP_BATCH_CHECKS, TpBatchCheck
from dtlab.core.traced import eager_when_traced
from dtlab.errors import CollectiveMismatchError, StrategyError

__all__ = ["SameOnTp", "check_same_on_tp"]

_PERIOD = 65521  # position weights 1..65521 (prime): |word * weight| < 2**31
_CHUNK = 32 * _PERIOD  # words read at a time (bounds the float64 copy: 16 MiB)
_MOD = (1 << 31) - 1  # each checksum modulo this prime before the tensors' are combined
_DEPTH = 4  # nesting of lists, tuples and dicts looked into
_PLAIN = (bool, int, float, str, type(None))

#: a leaf of the inputs: its name, its description (a tensor's shape and dtype) and the tensor, if one
Leaf = tuple[str, str, "torch.Tensor | None"]


def _leaves(name: str, value: Any, out: list[Leaf], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        out.append((name, f"shape {tuple(value.shape)}, {value.dtype}", value))
    elif isinstance(value, (list, tuple)) and depth < _DEPTH:
        for i, v in enumerate(value):
            _leaves(f"{name}[{i}]", v, out, depth + 1)
    elif isinstance(value, Mapping) and depth < _DEPTH:
        for k, v in value.items():
            _leaves(f"{name}[{k!r}]", v, out, depth + 1)
    else:
        out.append((name, repr(value)[:80] if isinstance(value, _PLAIN) else type(value).__name__, None))


def _checksums(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of ``t``'s memory as 16-bit words (bytes for 1-byte dtypes) and that sum weighted by
    position (1..65,521, repeating: a batch whose samples come in another order differs). Exact, so
    equal on every device, thread count and reduction order: each row of 65,521 words is summed in
    float64, where every partial sum is an integer below 2**47, then the rows in int64."""
    if t.is_meta or t.layout != torch.strided or t.is_quantized or t.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64)  # no bits to read: the structure covers shape and dtype
        return zero, zero
    flat = t.detach().contiguous().reshape(-1)  # a strided column, an expanded tensor: copied
    words = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    width = min(words.numel(), _PERIOD)
    weights = torch.arange(1, width + 1, dtype=torch.float64, device=t.device)
    total = weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):  # a whole number of rows at a time
        chunk = words[start : start + _CHUNK].to(torch.float64)
        whole = chunk.numel() // width * width
        rows, tail = chunk[:whole].view(-1, width), chunk[whole:]
        sums = torch.cat([rows.sum(1), tail.sum().reshape(1)]).to(torch.int64)
        dots = torch.cat([rows @ weights, (tail @ weights[: tail.numel()]).reshape(1)]).to(torch.int64)
        total, weighted = total + sums.sum(), weighted + dots.sum()
    return total, weighted


#: one rank's view of its inputs: per leaf its name, description and checksums
Seen = list[tuple[str, str, list[int]]]


def _difference(mine: Seen, first: Seen, rank0: str) -> str:
    """How one rank's inputs differ from those of its group's rank 0 (called ``rank0``): the names, or
    the first leaf that differs."""
    if [n for n, _, _ in mine] != [n for n, _, _ in first]:
        return f"its inputs are {[n for n, _, _ in mine]}, {rank0}'s {[n for n, _, _ in first]}"
    for (name, desc, sums), (_, desc0, sums0) in zip(mine, first, strict=True):
        if desc != desc0:
            return f"{name} is {desc}, on {rank0} {desc0}"
        if sums != sums0:
            return f"{name} has other values (same {desc})"
    return "the checksums differ"  # unreachable: equal descriptions and sums give equal digests


def _all_equal(group: CommunicationBackend, values: torch.Tensor) -> bool:
    """Whether every rank of ``group`` holds ``values``: one all-reduce of the max and negated min."""
    both = torch.cat([values, -values])
    group.all_reduce(both, ReduceOp.MAX)
    return torch.equal(both[: len(values)], -both[len(values) :])


def check_same_on_tp(
    who: str,
    what: str,
    named: Sequence[tuple[str, Any]],
    group: CommunicationBackend,
    ranks: Sequence[int],
    direct: bool = False,
    axis: str = "tp",
    labels: Sequence[str] | None = None,
) -> None:
    """Raise :class:`StrategyError` on every rank of ``group`` (the tp group, or with ``axis="pp"`` a
    pipeline's ranks, of every stage's tp group too; world ranks ``ranks``, named ``labels``: by
    default ``"tp rank 1"``) unless every rank passed the same ``named`` values (tensors, nested in
    lists/tuples/dicts, and plain Python values): the same names, shapes, dtypes and bits. Collective
    over ``group``. ``direct``: the wrapped module called outside the wrapper (``generate()``), whose
    later inputs are its own tokens."""
    leaves: list[Leaf] = []
    for name, value in named:
        _leaves(name, value, leaves)
    sums = {
        i: torch.stack(_checksums(t)).to(group.device) for i, (_, _, t) in enumerate(leaves) if t is not None
    }
    structure = "\n".join(f"{name}: {desc}" for name, desc, _ in leaves).encode()
    digest = int.from_bytes(hashlib.blake2b(structure, digest_size=7).digest(), "little")
    fp = torch.zeros(3, dtype=torch.int64, device=group.device)
    fp[0] = digest
    if sums:
        weights = torch.tensor([i + 1 for i in sums], dtype=torch.int64, device=group.device)
        stacked = torch.stack(list(sums.values())).remainder(_MOD)  # (tensors, 2)
        fp[1:] = (stacked * weights.unsqueeze(1)).sum(0)
    try:
        if _all_equal(group, fp):
            return
    except CollectiveMismatchError as exc:  # the first collective of each forward: the ranks ran others
        raise StrategyError(
            f"{who}: the check of the {what} on world rank {ranks[group.rank]} met another collective of its "
            f"tensor-parallel group ({exc}): its ranks ran different forwards, e.g. one evaluated alone (a "
            "DDP habit: if rank == 0: evaluate). Every rank of a tp group runs each forward, each on its "
            "slice of the layers: evaluate on every rank (the same batch on each tp rank), or call "
            "model.state_dict() on every rank and evaluate a plain copy on one rank"
        ) from exc
    mine = [(name, desc, sums[i].tolist() if i in sums else []) for i, (name, desc, _) in enumerate(leaves)]
    every = group.all_gather_object(mine)
    named_as = list(labels) if labels is not None else [f"{axis} rank {r}" for r in range(len(ranks))]
    differing = [
        f"{named_as[r]} (world rank {ranks[r]}): {_difference(d, every[0], named_as[0])}"
        for r, d in enumerate(every)
        if d != every[0]
    ]
    raise StrategyError(
        f"{who}: the ranks of a {_GROUP[axis][0]} were given different {what}; {'; '.join(differing)} "
        f"({named_as[0]} is world rank {ranks[0]}). {_GROUP[axis][1]}: give every {_GROUP[axis][2]} the same "
        "batch (inputs and targets), sharding the data by the dp coordinate, not by the global rank: "
        'part mesh.coordinate("dp") of mesh.size("dp"), e.g. dtlab.data.DistributedSampler(dataset, '
        'num_replicas=mesh.size("dp"), rank=mesh.coordinate("dp"))' + (_SAMPLED if direct else "")
    )


#: per axis: what its group is called, why its ranks need the same batch, and who is to be given it
_GROUP = {
    "tp": (
        "tensor-parallel group",
        "Every rank of a tp group computes the same model on the same batch, each on its slice of the layers",
        "tp rank",
    ),
    "pp": (
        "pipeline",
        "The stages of a pipeline run on one batch: the first stage reads the inputs, the last the "
        "targets (here one rank's inputs would be trained against another's targets)",
        "rank of the pipeline",
    ),
}

_SAMPLED = (
    ". If this is model.module.generate(...) given the same prompts on every tp rank: its inputs after the "
    "first forward are the tokens each rank chose, and the tp ranks chose different ones (do_sample=True: "
    "each rank drew from torch's generator on its own). Seed torch's generator alike on every tp rank "
    "before generate (torch.manual_seed(seed) in each process; in-memory ranks share one generator: "
    "decode greedily, do_sample=False)"
)


class SameOnTp:
    """A model's check of what it is given against its tp group (nothing when tp = 1): called with the
    inputs of ``forward``, the targets of a loss and the batch of ``train_step``, which checks its
    whole batch once (:meth:`step`: the forward and loss inside it are not checked again). ``module``:
    the wrapped module, whose inputs are checked too where it is called outside those (its own
    ``generate()``, ``model.module(x)``); the wrapper's calls of it run inside them.

    How often follows ``policy`` (:class:`~dtlab.core.plan.TpBatchCheck`) and nothing else: ``"first"``
    counts the checks of each kind (inputs, targets, batches), which every rank of the group makes in
    the same order (the model's own tp collectives need the same calls), so every rank decides alike.
    Building it compares the ranks' policies (one all-reduce of 4 int64 over the group): a rank given
    another policy would skip a collective the others wait in."""

    def __init__(
        self,
        who: str,
        group: CommunicationBackend,
        ranks: Sequence[int],
        policy: TpBatchCheck,
        module: nn.Module | None = None,
    ) -> None:
        self.who, self.group, self.ranks, self.policy = who, group, list(ranks), policy
        self._inside = False
        self._made: dict[str, int] = {}  # checks made so far, by kind (inputs, targets, batches)
        #: a pipeline's check of the same batch over every rank of the pipeline (pp x tp), made instead of
        #: this one at a step or inference (which, refusing on this tp group alone, would leave the other
        #: stages waiting for it); called with whether this one is due, it checks then and at first use
        self.over_pipeline: Callable[[str, str, list[tuple[str, Any]], bool], None] | None = None
        if group.world_size > 1:
            self._agree_on_policy()
            if module is not None:  # the wrapped module called directly (model.module.generate(...)),
                # before anything else of its forward (a sharded strategy's gathers)
                module.register_forward_pre_hook(self._direct, with_kwargs=True, prepend=True)

    def _agree_on_policy(self) -> None:
        mine = [TP_BATCH_CHECKS.index(self.policy.when), self.policy.first]
        if _all_equal(self.group, torch.tensor(mine, dtype=torch.int64, device=self.group.device)):
            return
        every = self.group.all_gather_object(self.policy)
        policies = "; ".join(f"tp rank {r} (world rank {self.ranks[r]}): {p}" for r, p in enumerate(every))
        raise StrategyError(
            f"{self.who}: the ranks of a tensor-parallel group were built with different tp_batch_check "
            f"policies, {policies}. The check is a collective: a rank that skips it while another checks "
            "would hang; pass the same tp_batch_check on every rank"
        )

    def _due(self, what: str) -> bool:
        """Whether this call is checked (the same answer on every rank of the group)."""
        when = self.policy.when
        if when == "first":
            made = self._made.get(what, 0)
            if made >= self.policy.first:
                return False
            self._made[what] = made + 1
        return when != "never"

    def __call__(self, what: str, named: Sequence[tuple[str, Any]], direct: bool = False) -> None:
        eager_when_traced(self._check)(what, named, direct)  # traced: one graph break, checked eagerly

    def _check(self, what: str, named: Sequence[tuple[str, Any]], direct: bool) -> None:
        if self.group.world_size > 1 and not self._inside and self._due(what):
            check_same_on_tp(self.who, what, named, self.group, self.ranks, direct)

    def _direct(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The wrapped module's inputs, where it runs outside the wrapper's forward (checked there)."""
        self("inputs", _named(args, kwargs), direct=True)

    def step(self, batch: tuple[Any, Any]) -> AbstractContextManager[None]:
        """Check ``(inputs, targets)``, then run the step without checking again."""
        return self._whole("batches", [("inputs", batch[0]), ("targets", batch[1])])

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AbstractContextManager[None]:
        """Check a forward's inputs, then run it without checking them again (the module's own call)."""
        return self._whole("inputs", _named(args, kwargs))

    @contextmanager
    def _whole(self, what: str, named: list[tuple[str, Any]]) -> Iterator[None]:
        """A step's batch or a forward's inputs, checked, then the block run without checking again:
        under a pipeline checked over all of it (every rank of the pipeline makes the same calls, so
        learns the same outcome), else over the tp group."""
        if self.over_pipeline is None:
            self(what, named)
        else:
            due = self.group.world_size > 1 and not self._inside and self._due(what)
            self.over_pipeline(self.who, what, named, due)
        was, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = was


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    return [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
