"""The gradients over tp after each synchronization of the data-parallel strategy (its post-sync
hooks): partial gradients summed (:class:`PartialGrads`), ``param.grad`` of a piece refusing a norm
(:class:`TensorParallelGrads`), replicated parameters' gradients compared (:class:`SameReplicatedGrads`);
and where a strategy's synchronized gradients lie (:func:`grads_of`).

Parameters left whole whose gradient each tp rank computes only its share of (sequence parallelism's
norms and row-parallel biases, ``replicated_with_grad_allreduce``) are summed over tp after each
synchronization, after the dp average (the two sums commute). A gradient kept across steps
(``opt.step()`` without ``zero_grad()``: torch adds the next backward into ``.grad``) still holds the
last sum, the same on every tp rank; summing it again would count it tp times. So the next forward
with gradients keeps it on tp rank 0 only; a second synchronized backward before the step is refused
(:meth:`PartialGrads.before_accumulate`).

``param.grad`` of a tensor-parallel parameter (of every parameter on a pipeline rank) refuses norms:
the norm of a shard (of one stage's parameters) is not the norm of the gradient. Under DDP and ZeRO-1
with all-reduce, ``param.grad`` of a parameter split over ``tp`` is this rank's piece of the averaged
gradient (a view of its bucket). Element-wise use is right on a piece (torch's ``clip_grad_value_``,
indexing, in-place writes, a copy), but torch's ``clip_grad_norm_`` over ``model.parameters()`` would
take each tp rank's partial norm: a norm that differs from one process's and a clip coefficient that
differs between tp ranks, so their replicated parameters drift apart. On a pipeline rank the same
holds for every parameter: ``model.parameters()`` has gradients for this rank's stages only. After each
synchronization such a ``param.grad`` is a :class:`~dtlab.models.dp._grad_guard.GradientStandIn`
wrapping that view: every operation runs on the view but a norm, which raises naming
``opt.clip_grad_norm_``. The model's next forward (or ``zero_grad()``) puts the view back.

A parameter the tensor plan leaves whole must get the same gradient on every tp rank: the ranks
compute one model on one batch (:mod:`dtlab.models.tensor._agree`), the column-parallel layers sum
their input's gradient over tp, so every rank's backward yields the whole gradient of each replicated
parameter. One used on the activations the plan splits (a norm applied per head after a column-split
projection, a scale on a column-parallel layer's output) gets only this rank's share instead, and
nothing sums it over tp unless the plan says so (``"replicated_with_grad_allreduce"``): each rank would
step its copy with another partial gradient and the copies drift apart, silently (as under torch's
DTensor tensor parallelism and Megatron-LM). A static rule cannot tell such a parameter from one used
before the split (an input-side norm), so :class:`SameReplicatedGrads` compares what the backward gave.

After the first synchronized backward each tp rank fingerprints every such gradient (float64: its sum
of squares and two sums of its elements with fixed pseudo-random signs, of its dp-averaged gradient or
summed over this rank's dp shards); one all-reduce (MAX of the fingerprints and of their negatives)
gives the group's largest and smallest, the same numbers on every rank, so every rank decides alike.
A spread beyond round-off (relative to the gradient's norm) is refused on every rank, naming the
parameters and the plan entries that fix it. A gradient that is zero (or not finite) everywhere tells
nothing: those parameters are looked at again at the 2nd, 4th, 8th, ... synchronized backward until
each had one. The cost, once: one all-reduce of 48 bytes per parameter over tp, one of 24 bytes per
parameter over dp where the gradients are sharded over dp, one of 16 bytes over pp with a pipeline
(every stage decides alike). docs/your_model.md, "Parameters on split activations".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError
from dtlab.models.dp._grad_guard import GradientStandIn
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.tensor._comm import sum_over_tp

__all__ = ["PartialGrads", "SameReplicatedGrads", "TensorParallelGrads", "grads_of"]

_NORMS = frozenset({torch.ops.aten.linalg_vector_norm, torch.ops.aten.norm, torch.ops.aten._foreach_norm})  # noqa: SLF001 - torch's op namespace


def _message(name: str, who: str, staged: bool) -> str:
    what = (
        "on this pipeline rank, which holds only its stages' parameters: the norm over model.parameters() "
        "misses the other stages', so torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would clip "
        "each stage by a different partial norm (a wrong step)"
        if staged
        else "this rank's tensor-parallel piece of the gradient: its norm is not the gradient's, so "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would clip each tp rank by a different "
        "partial norm (a wrong step, replicated parameters drifting apart)"
    )
    return (
        f"param.grad of {name!r} under {who} is {what}. "
        "Clip with opt.clip_grad_norm_(max_norm) (the global norm over the whole mesh, as one process's), "
        "or opt.clip_grad_value_(value); element-wise use of param.grad (clip_grad_value_, copies, "
        "in-place writes) works on the piece"
    )


class TensorParallelGrads:
    """Wraps the ``.grad`` of the tp-split parameters ``split`` (all parameters where ``staged``: a
    pipeline rank) after each synchronization of ``dp`` (where they are whole views: DDP, ZeRO-1 with
    all-reduce) and unwraps them on :meth:`release`."""

    def __init__(self, dp: DataParallelModel, split: set[str], who: str, staged: bool) -> None:
        #: each guarded parameter and its refusal, written once
        self._params = [
            (p, _message(n, who, staged)) for n, p in dp.trainable_parameters() if staged or n in split
        ]
        self._wrapped: list[tuple[nn.Parameter, GradientStandIn]] = []
        if self._params:
            dp.register_post_sync_hook(self.guard)

    def guard(self) -> None:
        for p, message in self._params:
            g = p.grad
            if g is not None and type(g) is torch.Tensor:  # not a stand-in of a sharded gradient
                wrapped = GradientStandIn(g, message, piece=g, refused=_NORMS)
                p.grad = wrapped
                self._wrapped.append((p, wrapped))

    def release(self) -> None:
        """Before a forward: the views again (a ``.grad`` set since, or None, is left alone)."""
        for p, wrapped in self._wrapped:
            if p.grad is wrapped:
                p.grad = wrapped.piece
        self._wrapped.clear()


def grads_of(
    dp: DataParallelModel, wanted: Callable[[str], bool], whole: bool | None = None
) -> list[torch.Tensor]:
    """This rank's synchronized gradient of every parameter whose name ``wanted`` accepts: the whole
    ``.grad`` where ``whole`` (default: where the strategy keeps whole gradients, DDP and ZeRO-1), else
    the pieces of its flat gradient shards (each rank holds the average of its own slice). The list
    has the same layout on every rank with the same local shapes (the same buckets and units)."""
    if dp.keeps_whole_grads if whole is None else whole:
        return [g for n, g in dp.whole_grads() if wanted(n)]
    out: list[torch.Tensor] = []
    for unit in dp.shard_units():
        g = dp.shard_grad(unit)
        out.extend(g[off : off + b - a] for slot, a, b, off in unit.shard_slots() if wanted(slot.name))
    return out


class PartialGrads:
    """The partial gradients of the parameters ``names`` (none at tp = 1) of ``dp``'s module."""

    def __init__(self, dp: DataParallelModel, names: set[str], tp: CommunicationBackend) -> None:
        self.dp, self.names, self.tp = dp, names, tp
        self._summed = False  #: whether the gradients may hold a sum over tp since the last zero_grad()
        if names:
            dp.register_post_sync_hook(self.sum)

    def sum(self) -> None:
        """After the dp reduction: each partial gradient summed over tp."""
        sum_over_tp(grads_of(self.dp, self.names.__contains__), self.tp)
        self._summed = True

    def before_accumulate(self, who: str) -> None:
        """Before a forward with gradients or a pipelined step of the model ``who``: refused while the
        last synchronized gradients are there (before the step); a sum over tp kept from the last step
        stays on tp rank 0 only, so the next sum counts it once."""
        dp = self.dp
        if self.names and dp.require_backward_grad_sync and dp.grads_synced:
            raise StrategyError(
                f"{who} with sequence parallelism: a synchronized step started while the "
                "gradients of the last one are still there; call opt.zero_grad() between steps and "
                "accumulate micro-batches inside model.no_sync()"
            )
        if self._summed:
            self._summed = False
            if self.tp.rank:
                for g in grads_of(self.dp, self.names.__contains__):
                    g.zero_()

    def cleared(self) -> None:
        """``zero_grad()``: nothing summed is held any more."""
        self._summed = False


_PERIOD = 65537  # the sign tables' length (prime): element i of a gradient is weighted by entry i mod it
_CHUNK = 1 << 20  # elements fingerprinted at a time (bounds the float64 copies: 8 MiB each)
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _tolerance(dtype: torch.dtype) -> float:
    """The relative spread round-off may leave between ranks: 1e-3 in float32/64 (GPU kernels that
    accumulate with atomics sum in another order on each rank; a partial gradient, another dropout
    mask or a compressor's selection differ by tens of percent), two units of the last place in
    16-bit floats."""
    return max(1e-3, 2 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3


def _module_pattern(name: str) -> str:
    """The plan entry for the module holding parameter ``name`` (layer indices as ``*``)."""
    owner = name.rpartition(".")[0]
    return ".".join("*" if part.isdigit() else part for part in owner.split("."))


class SameReplicatedGrads:
    """Compares the gradients of ``dp``'s parameters named in ``same`` (left whole over ``tp`` and not
    summed over tp: the composition's ``same_grad_over_tp``) after the first synchronized backwards
    (a post-sync hook of ``dp``, after the sums over tp and pp the composition makes); refuses a
    difference on every rank (``who`` names the model, ``batch_check`` its tp_batch_check policy)."""

    def __init__(
        self,
        dp: DataParallelModel,
        same: frozenset[str],
        tp: CommunicationBackend,
        pp: CommunicationBackend,
        who: str,
        batch_check: str,
    ) -> None:
        self._dp, self._tp, self._pp, self._who, self._batch_check = dp, tp, pp, who, batch_check
        #: the parameters not compared yet (all, then those whose gradient was zero everywhere)
        self._pending = [n for n, _ in dp.trainable_parameters() if n in same]
        self._all = list(self._pending)
        self._syncs = 0
        self._waiting = False  # every parameter compared during a compressor's dense warm-up
        self._signs: torch.Tensor | None = None
        if tp.world_size > 1:  # every stage of a pipeline registers: the decision is made over pp too
            dp.register_post_sync_hook(self.after_sync)

    def after_sync(self) -> None:
        """At the 1st, 2nd, 4th, ... synchronized backward while some parameter is not compared yet;
        under a dp compressor with a dense warm-up of ``w`` steps, every parameter again at the
        ``w + 1``-th (its first compressed one: the warm-up's exchanges leave the gradients equal)."""
        if self._syncs < 0:
            return
        self._syncs += 1
        warm = getattr(getattr(self._dp.gradient_reducer, "compressor", None), "warmup_steps", 0)
        warm = warm if isinstance(warm, int) else 0
        if warm and self._syncs == warm + 1:
            self._pending = list(self._all)
        elif self._waiting or self._syncs & (self._syncs - 1):
            return
        spread, undecided = self._spreads() if self._pending else ({}, [])
        wrong = {n: r for n, (r, tol) in spread.items() if r > tol}
        flags = torch.tensor([float(bool(wrong)), float(bool(undecided))], dtype=torch.float64)
        if self._pp.world_size > 1:  # another stage's refusal (or its parameters left) counts here too
            flags = flags.to(self._pp.device)
            self._pp.all_reduce(flags, ReduceOp.MAX)
        self._pending = undecided
        self._waiting = not flags[1] and self._syncs <= warm  # until the first compressed step
        if not flags[1] and self._syncs > warm:
            self._syncs = -1  # every parameter compared (compressed, if a compressor warms up): never again
        if flags[0]:
            raise StrategyError(self._message(wrong))

    def _spreads(self) -> tuple[dict[str, tuple[float, float]], list[str]]:
        """Per pending parameter with a nonzero finite gradient: the tp group's spread of its
        fingerprint relative to its norm, and its tolerance; and the parameters still undecided."""
        dp, device = self._dp, self._tp.device
        index = {n: i for i, n in enumerate(self._pending)}
        prints = torch.zeros(len(index), 3, dtype=torch.float64, device=device)
        dtypes: dict[str, torch.dtype] = {}
        _, whole = dp.norm_grad_tensors()  # whole: every dp rank holds the whole average
        if whole:
            for n, g in dp.whole_grads():
                if n in index:
                    prints[index[n]] += self._fingerprint(g.reshape(-1), 0)
                    dtypes[n] = g.dtype
        else:
            for unit in dp.shard_units():
                flat = dp.shard_grad(unit)
                # every slot's dtype, held here or not: the tolerance must be the same on every dp rank
                dtypes.update((slot.name, flat.dtype) for slot in unit.slots if slot.name in index)
                for slot, a, b, off in unit.shard_slots():
                    if slot.name in index:
                        prints[index[slot.name]] += self._fingerprint(flat[off : off + b - a], a)
            if dp.dp_backend.world_size > 1:  # each dp rank fingerprinted its slices: the whole ones
                dp.dp_backend.all_reduce(prints, ReduceOp.SUM)
        both = torch.cat([prints, -prints])
        self._tp.all_reduce(both, ReduceOp.MAX)  # the group's largest and (negated) smallest
        hi, lo = both[: len(index)], -both[len(index) :]
        norm = hi[:, 0].clamp_min(0).sqrt()
        rel = torch.stack(
            [(hi[:, 0] - lo[:, 0]) / (2 * hi[:, 0]), *((hi[:, k] - lo[:, k]) / norm for k in (1, 2))]
        )
        decided = (torch.isfinite(hi).all(1) & torch.isfinite(lo).all(1) & (hi[:, 0] > 0)).tolist()
        worst = rel.max(0).values.tolist()
        spread = {
            n: (worst[i], _tolerance(dtypes.get(n, torch.float32))) for n, i in index.items() if decided[i]
        }
        return spread, [n for n, i in index.items() if not decided[i]]

    def _fingerprint(self, g: torch.Tensor, start: int) -> torch.Tensor:
        """``(sum of squares, sum with signs s1, sum with signs s2)`` of the flat piece ``g`` holding
        elements ``start...`` of its parameter, in float64."""
        if self._signs is None or self._signs.device != g.device:
            gen = torch.Generator().manual_seed(0x5EED)  # its own generator: torch's global RNG untouched
            signs = torch.randint(0, 2, (2, _PERIOD), generator=gen, dtype=torch.float64) * 2 - 1
            self._signs = signs.to(g.device)
        out = torch.zeros(3, dtype=torch.float64, device=g.device)
        for lo in range(0, g.numel(), _CHUNK):
            piece = g[lo : lo + _CHUNK].detach().to(torch.float64)
            at = torch.arange(start + lo, start + lo + piece.numel(), device=g.device).remainder_(_PERIOD)
            s = self._signs[:, at]
            out += torch.stack([piece.dot(piece), s[0].dot(piece), s[1].dot(piece)])
        return out.to(self._tp.device)

    def _message(self, wrong: dict[str, float]) -> str:
        if wrong:
            named = ", ".join(f"{n!r} (spread {r:.2g} of its norm)" for n, r in list(wrong.items())[:8])
            more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
            what = f"the gradients of {named}{more} differ between the ranks of the tensor-parallel group"
            patterns = sorted({_module_pattern(n) for n in wrong})
            entries = ", ".join(f"{p!r}: 'replicated_with_grad_allreduce'" for p in patterns if p)
            fix = (
                f"add {{{entries}}} to the plan (the module left whole, its gradient summed over tp)"
                if entries
                else "move it into a submodule and plan that module 'replicated_with_grad_allreduce'"
            )
        else:
            what = "on another pipeline stage the gradients of parameters left whole differ between tp ranks"
            fix = "mark the modules that stage's ranks name 'replicated_with_grad_allreduce' in the plan"
        causes = []
        dropouts = [
            n
            for n, m in self._dp.module.named_modules()
            if isinstance(m, _DROPOUT) and m.training and m.p > 0
        ]
        if dropouts:
            causes.append(
                f"the tp ranks drew different dropout masks where the model is not split (modules "
                f"{dropouts[:4]} have p > 0): every tp rank must draw the same numbers there (the same "
                "torch.manual_seed on each; in-memory ranks share one generator: use dropout 0)"
            )
        if self._batch_check != "always":
            causes.append(
                f"the tp ranks were given different batches (tp_batch_check={self._batch_check!r} did not "
                "compare them): give every tp rank the same batch, sharding the data by the dp coordinate"
            )
        causes.append(
            ("if none of these, " if causes else "")
            + "the parameter is used on activations the plan splits (a norm applied per head after a "
            "column-split projection, a scale or bias on a column-parallel layer's output), so each tp "
            f"rank's backward gives only its share of its gradient: {fix}; a Hugging Face model's own plan "
            "(plan='auto') marks such modules"
        )
        return (
            f"{self._who}: after the synchronized backward, {what}. Each tp rank holds the whole parameter "
            "and would step it with its own gradient, so the copies would drift apart (a silently wrong "
            "model). " + ("Cause: " if len(causes) == 1 else "Possible causes: ") + "; or ".join(causes) + "."
        )
