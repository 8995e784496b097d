"""One given plan: ``--plan "dp=8,tp=4,pp=12,strategy=zero1,schedule=1f1b,micro_batch=2,checkpointing=full"``.

Keys: ``strategy`` (ddp, zero1, zero2, zero3, fsdp), ``dp`` (default: what ``tp`` and ``pp`` leave of
the ranks), ``tp``, ``pp`` (default 1), ``schedule`` (default 1f1b with a pipeline), ``micro_batch``
(sequences per micro-batch) or ``micro_batches`` (how many; without a pipeline: gradient
accumulation; default: one micro-batch per dp rank, ``pp`` of them with a pipeline), ``v`` (chunks per
rank, interleaved 1F1B), ``checkpointing`` (none, block or its Megatron-LM name full, stage; true:
block without a pipeline, stage with one).
"""

from __future__ import annotations

from dataclasses import replace

from dtlab.advise.predict import Prediction
from dtlab.advise.spec import Candidate
from dtlab.core.plan import RunPlan
from dtlab.errors import ArgumentError

__all__ = ["parse_plan", "place"]

_KEYS = ("strategy", "dp", "tp", "pp", "schedule", "micro_batch", "micro_batches", "v", "checkpointing")
_CHECKPOINTING = {"none": "none", "false": "none", "block": "block", "full": "block", "stage": "stage"}


def _int(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ArgumentError(f"--plan: {key}={value!r} is not an integer") from None
    if n < 1:
        raise ArgumentError(f"--plan: {key}={n} must be >= 1")
    return n


def _fields(text: str) -> dict[str, str]:
    """``KEY=VALUE,...`` as a mapping (keys checked, each once)."""
    fields: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _KEYS:
            raise ArgumentError(f"--plan: {part!r} is not KEY=VALUE with a key among {', '.join(_KEYS)}")
        if key in fields:
            raise ArgumentError(f"--plan: {key} given twice")
        fields[key] = value.strip().lower()
    return fields


def _micro_batches(fields: dict[str, str], local: int, global_batch: int, dp: int, pp: int) -> int:
    """How many micro-batches each dp rank's ``local`` sequences are cut into."""
    if "micro_batch" in fields and "micro_batches" in fields:
        raise ArgumentError("--plan: give micro_batch (sequences) or micro_batches (how many), not both")
    if "micro_batch" in fields:
        size = _int("micro_batch", fields["micro_batch"])
        if local % size:
            raise ArgumentError(
                f"--plan: micro_batch={size} does not divide the {local} sequences per dp rank "
                f"(--global-batch {global_batch} / dp {dp})"
            )
        return local // size
    m = _int("micro_batches", fields.get("micro_batches", str(pp if pp > 1 else 1)))
    if local % m:
        raise ArgumentError(
            f"--plan: micro_batches={m} does not divide the {local} sequences per dp rank "
            f"(--global-batch {global_batch} / dp {dp})"
        )
    return m


#: how ``--plan``'s messages name the run plan's fields
_NAMES = {
    "data_parallel": "strategy",
    "stages_per_rank": "v",
    "world": "--ranks",
    "global_batch": "--global-batch",
}


def parse_plan(text: str, ranks: int, global_batch: int) -> Candidate:
    """The plan ``text`` describes on ``ranks`` ranks with ``global_batch`` sequences per step (its
    cross-field checks are the run plan's, :class:`dtlab.core.plan.RunPlan`)."""
    fields = _fields(text)
    if "strategy" not in fields:
        raise ArgumentError("--plan needs strategy=ddp|zero1|zero2|zero3|fsdp")
    tp = _int("tp", fields.get("tp", "1"))
    pp = _int("pp", fields.get("pp", "1"))
    v = _int("v", fields.get("v", "1"))
    schedule = fields.get("schedule", "interleaved_1f1b" if v > 1 else "1f1b")
    ckpt = fields.get("checkpointing", "none")
    if ckpt == "true":
        ckpt = "stage" if pp > 1 else "block"
    if ckpt not in _CHECKPOINTING:
        raise ArgumentError(
            f"--plan: checkpointing={ckpt!r}; choose none, block (or full), stage, true or false"
        )
    try:
        plan = RunPlan(
            fields["strategy"],
            pp=pp,
            dp=_int("dp", fields["dp"]) if "dp" in fields else None,
            tp=tp,
            schedule=schedule,
            stages_per_rank=v,
            names=_NAMES,
        ).resolve(ranks)
        dp = plan.mesh_shape["dp"]
        if global_batch % dp:
            raise ArgumentError(f"dp={dp} does not divide --global-batch {global_batch}")
        m = _micro_batches(fields, global_batch // dp, global_batch, dp, pp)
        if pp > 1:
            plan = replace(plan, micro_batches=m)
            plan.check_batch(global_batch)
    except ArgumentError as exc:
        raise ArgumentError(f"--plan: {str(exc).removeprefix('--plan: ')}") from None
    return Candidate.from_plan(plan, accumulation_steps=m, checkpointing=_CHECKPOINTING[ckpt])  # type: ignore[arg-type]


def place(plan: Prediction, ranked: list[Prediction]) -> int:
    """The plan's place among ``ranked`` (fastest first, 1-based): where it is, or where it would be."""
    for i, p in enumerate(ranked, 1):
        if p.candidate == plan.candidate:
            return i
    return 1 + sum(1 for p in ranked if p.step_seconds < plan.step_seconds)
