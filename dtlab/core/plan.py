"""The run plan: one validated, frozen description of how a run is laid out, built once and handed down.

:class:`RunPlan` holds the mesh sizes (``pp``, ``dp``, ``tp``), the data-parallel strategy on the dp
axis, the tensor plan, the pipeline schedule, micro-batches, stages per rank and split points, and
activation checkpointing. Every check that involves more than one of these is made here, once: the
config builds its plan with :func:`dtlab.parallel_config.run_plan` (messages name the config's fields,
``parallel.tp``, ``strategy.model``), Python code builds one directly (messages name the arguments),
and the Trainer, ``HybridShardedModel.from_plan`` and the run header read it instead of deciding
again::

    plan = RunPlan(data_parallel="fsdp", tp=2, pp=2, schedule="1f1b", micro_batches=4)
    plan = plan.resolve(world_size=8)                 # dp = 8 / (tp x pp) = 2, checked
    model = HybridShardedModel.from_plan(module, Mesh(backend, plan.mesh_shape), plan)

What a plan cannot know alone is checked where it is known: the world size (:meth:`RunPlan.resolve`),
the batch (:meth:`RunPlan.check_batch`), the model's pipeline blocks (:meth:`RunPlan.check_blocks`)
and its tensor plan (resolved against the module when the model is built). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal, cast, get_args

from dtlab.core.pairs import DATA_PARALLEL, SCHEDULES
from dtlab.errors import ArgumentError, integer

__all__ = ["AUTO", "TP_BATCH_CHECKS", "RunPlan", "TensorPlanSpec", "TpBatchCheck", "check_schedule_args"]

#: the tensor plan the model declares (its ``tp_plan()``, Hugging Face's ``_tp_plan``)
AUTO = "auto"
#: a tensor plan as a run plan holds it: :data:`AUTO` or ``{"fqn-pattern": style}``
TensorPlanSpec = str | Mapping[str, object]


def _positive_int(value: object, name: str) -> int:
    n = integer(value)
    if n is None or n < 1:
        raise ArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return n


#: how often a tensor-parallel model checks its tp group's batches (:class:`TpBatchCheck`)
TpBatchCheckWhen = Literal["always", "first", "never"]
TP_BATCH_CHECKS: tuple[str, ...] = get_args(TpBatchCheckWhen)


@dataclass(frozen=True)
class TpBatchCheck:
    """How often a model with tensor parallelism checks that every rank of its tp group was given the
    same batch (docs/strategies.md, "Every tp rank gets the same batch"; one small all-reduce each).

    ``when``: ``"always"`` (default): every forward, loss (``model.cross_entropy``) and ``train_step``;
    ``"first"``: the first ``first`` calls of each of the three (``first=1``: the first step, whichever
    way the loop is written; data sharded by the global rank differs from the first batch on);
    ``"never"``: no check and no collective (Megatron-LM's and torchtitan's behaviour), for a data
    pipeline known to be right. Decided from these two values and the calls alone, never from the
    data: ranks given the same policy check the same calls (the check is a collective; a rank that
    skipped it while another waited would hang), and a model compares its ranks' policies once, when
    it is built. Where a policy is taken, its ``when`` alone is too (``tp_batch_check="never"``).
    """

    when: TpBatchCheckWhen = "always"
    #: with ``when="first"``: how many calls of each kind are checked
    first: int = 1

    def __post_init__(self) -> None:
        if self.when not in TP_BATCH_CHECKS:
            raise ArgumentError(
                f"TpBatchCheck(when={self.when!r}): choose one of {', '.join(map(repr, TP_BATCH_CHECKS))}"
            )
        _positive_int(self.first, "TpBatchCheck.first")
        if self.first != 1 and self.when != "first":
            raise ArgumentError(
                f"TpBatchCheck(when={self.when!r}, first={self.first}): first counts the calls checked "
                "with when='first'; use when='first' or leave first at 1"
            )

    @classmethod
    def of(cls, value: object, who: str) -> TpBatchCheck:
        """``value`` as a policy: a :class:`TpBatchCheck` or one of :data:`TP_BATCH_CHECKS` (``"first"``:
        ``first=1``); anything else raises, naming ``who``'s argument and the choices."""
        if isinstance(value, TpBatchCheck):
            return value
        if isinstance(value, str) and value in TP_BATCH_CHECKS:
            return cls(cast(TpBatchCheckWhen, value))
        raise ArgumentError(
            f"{who}(tp_batch_check={value!r}): give one of {', '.join(map(repr, TP_BATCH_CHECKS))} or a "
            "TpBatchCheck(when, first=N)"
        )


def check_schedule_args(name: str, p: int, m: int, v: int = 1) -> None:
    """Refuse an unknown schedule or ``(p, m, v)`` it cannot run, naming the rule and the values."""
    if name not in SCHEDULES:
        raise ArgumentError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    _positive_int(p, "the pipeline size p")
    _positive_int(m, "micro_batches")
    _positive_int(v, "stages_per_rank")
    if name != "interleaved_1f1b" and v != 1:
        raise ArgumentError(
            f"schedule {name!r} runs one stage per rank, so stages_per_rank must be 1, got {v}; use "
            "schedule='interleaved_1f1b' for several stages per rank"
        )
    if name == "interleaved_1f1b":
        if v < 2:
            raise ArgumentError(
                f"schedule 'interleaved_1f1b' needs stages_per_rank >= 2 (with 1 it is '1f1b'), got {v}"
            )
        if m % p:
            lower, upper = max(p, m - m % p), m + p - m % p
            raise ArgumentError(
                f"schedule 'interleaved_1f1b' needs micro_batches to be a multiple of the pipeline size "
                f"(micro-batches go through the chunks in groups of p), got micro_batches={m} with p={p}; "
                f"use micro_batches={lower} or {upper}"
            )


#: how a plan built from Python names its fields in messages (the config passes its own spellings)
PYTHON_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "world": "world_size",
        "global_batch": "global_batch",
        "accumulation_steps": "accumulation_steps",
    }
)


@dataclass(frozen=True)
class RunPlan:
    """How a run is laid out: ``pp`` pipeline ranks x ``dp`` data-parallel replicas x ``tp``
    tensor-parallel ranks (tp innermost), ``data_parallel`` over the dp axis (a name of
    :data:`dtlab.core.pairs.DATA_PARALLEL`), the tensor plan (``"auto"``: the one the model declares),
    a pipeline ``schedule`` over ``micro_batches`` (default ``pp``) with ``stages_per_rank`` chunks per
    rank, cut at ``split_points`` (block names; ``None``: balanced by parameters), and how often the
    tp ranks' batches are compared (``tp_batch_check``, a :class:`TpBatchCheck`). Pipeline settings
    need ``pp > 1``; ``sequence_parallel`` needs ``tp > 1``. ``dp=None``: what the world leaves
    (:meth:`resolve`). Invalid combinations raise :class:`~dtlab.errors.ArgumentError` at construction.
    ``names`` (not compared): how messages spell each field (the config passes ``parallel.tp``, ...).
    """

    data_parallel: str = "ddp"
    pp: int = 1
    dp: int | None = None
    tp: int = 1
    tensor_plan: TensorPlanSpec = AUTO
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    micro_batches: int | None = None
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    activation_checkpointing: bool = False
    tp_batch_check: TpBatchCheck = TpBatchCheck()
    names: Mapping[str, str] = field(default_factory=lambda: PYTHON_NAMES, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.split_points is not None and not isinstance(self.split_points, tuple):
            object.__setattr__(self, "split_points", tuple(self.split_points))
        object.__setattr__(self, "tp_batch_check", TpBatchCheck.of(self.tp_batch_check, "RunPlan"))
        self._check_fields()
        if self.pp == 1:
            self._check_no_pipeline()
        else:
            self._check_pipeline()

    # ------------------------------------------------------------------ naming
    def name(self, key: str) -> str:
        """How messages spell field ``key`` (``tp`` or ``parallel.tp``)."""
        return self.names.get(key, key)

    def _is(self, key: str, value: object) -> str:
        return f"{self.name(key)}={value!r}"

    # ------------------------------------------------------------------ checks
    def _check_fields(self) -> None:
        for key in ("pp", "tp", "stages_per_rank"):
            _positive_int(getattr(self, key), self.name(key))
        for key in ("dp", "micro_batches"):
            if getattr(self, key) is not None:
                _positive_int(getattr(self, key), self.name(key))
        if self.data_parallel not in DATA_PARALLEL:
            raise ArgumentError(
                f"{self._is('data_parallel', self.data_parallel)}: the data-parallel strategy over the dp "
                f"axis is one of {', '.join(DATA_PARALLEL)}"
            )
        if self.schedule not in SCHEDULES:
            raise ArgumentError(
                f"{self._is('schedule', self.schedule)}: choose one of {', '.join(SCHEDULES)}"
            )
        plan = self.tensor_plan
        mapping = isinstance(plan, Mapping) and plan and all(isinstance(k, str) for k in plan)
        if not (plan == AUTO or mapping):
            raise ArgumentError(
                f"{self._is('tensor_plan', plan)}: give {AUTO!r} (the plan the model declares) or a "
                "non-empty {'fqn-pattern': style} mapping"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ArgumentError(
                f"{self.name('sequence_parallel')}=true needs {self.name('tp')} > 1 (it splits tp's norm "
                "regions)"
            )
        if self.sequence_parallel and plan != AUTO:
            raise ArgumentError(
                f"{self.name('sequence_parallel')}=true selects the sequence-parallel variant of the plan "
                f"the model declares ({self.name('tensor_plan')}={AUTO!r}); a given plan says it in its "
                "styles (sequence_parallel=True on each)"
            )

    def _check_no_pipeline(self) -> None:
        if self.micro_batches is not None and self.micro_batches != 1:
            raise ArgumentError(
                f"{self.name('micro_batches')}={self.micro_batches} applies to pipelines "
                f"({self.name('pp')} > 1); with {self.name('pp')}=1 accumulate with "
                f"{self.name('accumulation_steps')} instead"
            )
        if self.split_points:
            raise ArgumentError(
                f"{self.name('split_points')}={list(self.split_points)} cuts pipeline stages, but "
                f"{self.name('pp')}=1; set {self.name('pp')} > 1 or leave {self.name('split_points')} unset"
            )
        if self.stages_per_rank != 1:
            raise ArgumentError(
                f"{self.name('stages_per_rank')}={self.stages_per_rank} applies to pipelines "
                f"({self.name('pp')} > 1)"
            )

    def _check_pipeline(self) -> None:
        n = self.name
        pp, v, m = self.pp, self.stages_per_rank, self.micro_batch_count
        if m < pp:
            raise ArgumentError(
                f"{n('micro_batches')}={m} is fewer than {n('pp')}={pp}: every stage would idle while it "
                f"waits; use {n('micro_batches')} >= {pp}"
            )
        try:
            check_schedule_args(self.schedule, pp, m, v)
        except ArgumentError as exc:
            raise ArgumentError(
                f"{self._is('schedule', self.schedule)} with {n('pp')}={pp}, {n('micro_batches')}={m}, "
                f"{n('stages_per_rank')}={v}: {exc}"
            ) from None
        if self.activation_checkpointing and self.schedule == "zero_bubble":
            raise ArgumentError(
                f"{n('activation_checkpointing')}=true with {n('schedule')}='zero_bubble': zero-bubble "
                "defers the weight gradients of the forward it recorded, which a checkpointed stage "
                f"recomputes; use {n('schedule')}=1f1b (or gpipe, interleaved_1f1b) with checkpointing"
            )
        points = self.split_points
        if points is not None and (len(points) != self.stages - 1 or len(set(points)) != len(points)):
            raise ArgumentError(
                f"{n('split_points')}={list(points)}: {self.stages} stages need {self.stages - 1} distinct "
                "block names after the first, in order"
            )

    # ------------------------------------------------------------------ derived
    @property
    def model_parallel(self) -> bool:
        """Whether the run needs a mesh (tensor or pipeline parallelism)."""
        return self.tp > 1 or self.pp > 1

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def micro_batch_count(self) -> int:
        """Micro-batches per step of each pipeline (``micro_batches``, default ``pp``)."""
        return self.micro_batches if self.micro_batches is not None else self.pp

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def resolved(self) -> bool:
        return self.dp is not None

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "tp": ..}``, outermost first (after :meth:`resolve`)."""
        if self.dp is None:
            raise ArgumentError("RunPlan.mesh_shape needs dp: call plan.resolve(world_size) first")
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    @property
    def class_name(self) -> str:
        """The model strategy the plan builds: the data-parallel one alone, or the composition."""
        return "HybridShardedModel" if self.model_parallel else self.data_parallel

    def resolve(self, world_size: int) -> RunPlan:
        """This plan on ``world_size`` ranks: ``dp`` filled in (what tp x pp leave), the mesh checked to
        fill the world exactly."""
        n = self.name
        _positive_int(world_size, n("world"))
        tp, pp = self.tp, self.pp
        if self.dp is not None:
            if self.dp * tp * pp != world_size:
                raise ArgumentError(
                    f"{n('dp')}={self.dp} x {n('tp')}={tp} x {n('pp')}={pp} = {self.dp * tp * pp} ranks, but "
                    f"the world has {world_size} ({n('world')}); make the product equal {world_size} or "
                    f"leave {n('dp')} unset (world / (tp x pp))"
                )
            return self
        if world_size % (tp * pp):
            raise ArgumentError(
                f"{n('tp')}={tp} x {n('pp')}={pp} = {tp * pp} does not divide the world of {world_size} "
                f"ranks ({n('world')}); the dp axis is world / (tp x pp)"
            )
        return replace(self, dp=world_size // (tp * pp))

    def check_batch(self, global_batch: int, accumulation_steps: int = 1) -> None:
        """The global batch splits over the dp ranks x accumulation steps, and each dp rank's share into
        the pipeline's micro-batches (accumulation is the micro-batches with a pipeline)."""
        n, dp = self.name, self.mesh_shape["dp"]
        g, a = global_batch, accumulation_steps
        if self.pp > 1 and a > 1:
            raise ArgumentError(
                f"{n('accumulation_steps')}={a} with {n('pp')}={self.pp}: the pipeline's micro-batches "
                f"are its accumulation; set {n('micro_batches')} instead"
            )
        if g % (dp * a):
            ok = dp * a
            axis = "the dp axis" if self.model_parallel or self.dp != dp else "the world size"
            why = (
                f" (dp = {n('dp')} or world / (tp {self.tp} x pp {self.pp}))"
                if axis != "the world size"
                else ""
            )
            raise ArgumentError(
                f"{n('global_batch')}={g} is not divisible by {axis} x {n('accumulation_steps')} = "
                f"{dp} x {a} = {ok}{why}; use a multiple of {ok} (e.g. {max(ok, g - g % ok)})"
            )
        mb = self.micro_batch_count
        if self.pp > 1 and (g // dp) % mb:
            ok = dp * mb
            raise ArgumentError(
                f"{n('global_batch')}={g} gives each of the {dp} dp ranks {g // dp} samples, not divisible "
                f"into {n('micro_batches')}={mb}; use a global batch that is a multiple of dp x "
                f"micro_batches = {ok} (e.g. {max(ok, g - g % ok)})"
            )

    def check_blocks(self, blocks: Sequence[str]) -> None:
        """``split_points`` name blocks of the model (``blocks``: its pipeline blocks in order), in
        order, none the first."""
        points = self.split_points
        if self.pp == 1 or points is None:
            return
        unknown = [p for p in points if p not in blocks]
        order = [list(blocks).index(p) for p in points if p in blocks]
        if unknown or order != sorted(set(order)) or 0 in order:
            raise ArgumentError(
                f"{self.name('split_points')}={list(points)}: {self.stages} stages need {self.stages - 1} "
                f"distinct block names after the first, in order, from {list(blocks)}"
                + (f" ({unknown} name no block)" if unknown else "")
            )

    def describe(self) -> str:
        """``fsdp over dp 2 x tp 2 x pp 2 (1f1b, 4 micro-batches)`` for run headers and messages."""
        sizes = " x ".join(f"{a} {s}" for a, s in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if s)
        text = f"{self.data_parallel} over {sizes}" if self.model_parallel else self.data_parallel
        if self.pp > 1:
            v = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            text += f" ({self.schedule}, {self.micro_batch_count} micro-batches{v})"
        return text
