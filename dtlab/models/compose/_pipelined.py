"""A pipelined composition's step on this rank: each stage called through the data-parallel strategy,
the schedule run with every backward inside ``no_sync()`` (ZeRO-3/FSDP: each unit gathered once for
the step), then one all-reduce over pp of the loss and of each rank's count of parameters no
micro-batch used and, without ``find_unused_parameters``, one over dp of every replica's counts (any:
refused on every rank), the tied weights summed and the dp reduction; and inference through every
stage. The tensors crossing stage boundaries come, per micro-batch shape, from a forward on the meta
device (block stages) or the checked trace (a model split at module names, whose stages are then told
the traced block outputs their stubs return)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.backends.mesh import MeshLike
from dtlab.errors import StrategyError
from dtlab.models.compose._build import Layout
from dtlab.models.compose._tied import TiedSync
from dtlab.models.dp._unused import everywhere_unused_error
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.pipeline._comm import (
    StageLinks,
    counts_over_dp,
    infer_through_stages,
    loss_and_counts_over_pp,
)
from dtlab.models.pipeline._runtime import GRAPHLESS_LOSS, StepResult, run_schedule
from dtlab.models.pipeline._schedules import PipelineSchedule
from dtlab.models.pipeline._split import Stage, TensorSpec, TupleSpec, stage_specs
from dtlab.models.pipeline._trace import TracedStage
from dtlab.models.pipeline._trace_check import Trace, output_tensor, trace_split
from dtlab.models.step_args import described
from dtlab.models.tensor._agree import check_same_on_tp
from dtlab.models.tensor._split_logits import unmarked

__all__ = ["ONE_TENSOR", "PipelineRun"]

ONE_TENSOR = (
    "a pipeline feeds inputs (one tensor) to its first stage and targets (one tensor) to loss_fn(output, "
    "targets) on its last, and one tensor crosses each stage boundary: put what the loss reads besides "
    "the output into targets (torch.cat, or labels -100 where a mask is 0); an input the stages need "
    "(an attention mask) does not reach them: pad on the right with targets -100 on the pads (a causal "
    "model's other positions never see them)"
)


class PipelineRun:
    """This rank's stages of ``schedule`` over ``pp``, run through ``dp`` (which wraps them)."""

    def __init__(
        self,
        dp: DataParallelModel,
        layout: Layout,
        schedule: PipelineSchedule,
        mesh: MeshLike,
        module: nn.Module,
        tied: TiedSync,
        checkpointing: bool,
    ) -> None:
        self.dp, self.layout, self.schedule, self.pp = dp, layout, schedule, mesh["pp"]
        # the batch check's group: every rank of this pipeline, each stage's tp ranks too (a check over
        # pp alone after the tp check would wait for a stage whose tp check refused its ranks alone)
        axes = tuple(a for a in mesh.axis_names if a in ("pp", "tp") and mesh.size(a) > 1) or ("pp",)
        self._same_group, self._same_ranks = mesh[axes], mesh.ranks(axes)
        coords = itertools.product(*(range(mesh.size(a)) for a in axes))  # row-major, as the group's ranks
        self._same_labels = [
            ", ".join(f"{a} rank {c}" for a, c in zip(axes, at, strict=True)) for at in coords
        ]
        self._compared: set[str] = set()  # what the ranks were checked to agree on (at its first use)
        self.module = module  # the user's whole module (other stages on meta), for the trace
        self.tied, self.checkpointing = tied, checkpointing
        #: the last step's compute intervals and activation peak (None before the first step)
        self.last: StepResult | None = None
        #: the inference output on every pp rank alike: marked where the logits are split over tp
        self.mark_output: Callable[[torch.Tensor], torch.Tensor] = unmarked
        #: the exception a step's schedule raised on this rank (None: none since the last zero_grad())
        self.failed: str | None = None
        self._specs: dict[TensorSpec, list[TensorSpec]] = {}
        self._traces: dict[TensorSpec, Trace] = {}

    def stage_forward(self, x: torch.Tensor, stage: int, *inputs: torch.Tensor) -> Any:
        """One stage through the data-parallel strategy's forward (its buffers, gathers and hooks); the
        activations ZeRO-3/FSDP's own saved-tensor hooks keep go on to the hooks around the stage (the
        pipeline's meter, or its checkpointing). A stage of a model split at module names also gets the
        micro-batch's model ``inputs``."""
        return self.dp(x, stage, *inputs) if self.layout.traced else self.dp(x, stage)

    def specs_for(self, sample: torch.Tensor) -> list[TensorSpec]:
        """Each stage's output spec for micro-batches like ``sample`` (computed once per shape, alike on
        every rank)."""
        key = TensorSpec(tuple(sample.shape), sample.dtype)
        layout = self.layout
        if key not in self._specs:
            with self.dp.gather_hooks_suspended():  # ZeRO-3/FSDP hold only shards at rest
                if layout.traced:
                    stages = cast("list[TracedStage]", layout.stages)
                    trace = trace_split(self.module, stages, layout.whole_shapes, sample)
                    self._traces[key], self._specs[key] = trace, trace.specs
                else:
                    self._specs[key] = stage_specs(cast("list[Stage]", layout.stages), layout.shapes, key)
        if layout.traced:
            trace = self._traces[key]
            for stage in cast("list[TracedStage]", layout.stages):
                stage.prepare(trace.outputs, trace.slots)
        return self._specs[key]

    def same_on_pp(self, who: str, what: str, named: list[tuple[str, Any]], due: bool = False) -> None:
        """At the first step (``what="batches"``) or inference (``"inputs"``), and at each one the tp
        check is ``due`` for (made here instead: over its tp group alone, a refusal would leave the
        other stages waiting): refuse, on every rank of the pipeline (pp x tp), ranks given other values
        (data sharded by the global rank; one all-reduce of 6 int64 over pp x tp)."""
        if what == "batches":  # after a schedule that raised: refused on this rank, before a collective
            self._check_not_failed()  # the other stages may still be waiting in the one it left
        if self.pp.world_size > 1 and (due or what not in self._compared):
            self._compared.add(what)
            who = f"{who}.train_step" if what == "batches" else who
            group, ranks, labels = self._same_group, self._same_ranks, self._same_labels
            check_same_on_tp(who, what, named, group, ranks, axis="pp", labels=labels)

    def infer(self, x: torch.Tensor) -> Any:
        """Inference through every stage (no autograd across ranks), the output on every pp rank: a
        model split at module names gives its logits in the plain model's output class."""
        specs = self.specs_for(x)
        last = self.schedule.num_stages - 1

        def run(h: torch.Tensor, s: int) -> Any:
            out = self.stage_forward(h, s, x)
            tensor = output_tensor(out) if s == last and self.layout.traced else out
            if not isinstance(tensor, torch.Tensor) and not isinstance(specs[s], TupleSpec):
                raise StrategyError(f"pipeline stage {s} returned a {type(out).__name__}")  # unreachable
            return tensor

        got = infer_through_stages(x, run, specs, self.schedule, self.pp)
        if isinstance(got, tuple):  # the last stage's tuple: its items split over tp marked as such
            marked = cast("TupleSpec", specs[-1]).marked
            return tuple(self.mark_output(t) if m else t for t, m in zip(got, marked, strict=True))
        out = self.mark_output(got)
        if self.layout.traced:
            return self._traces[TensorSpec(tuple(x.shape), x.dtype)].as_output(out)
        return out

    def _check_not_failed(self) -> None:
        """Refuse a step after one whose schedule raised (a forward, loss or backward of a micro-batch):
        with one stage per rank after ``zero_grad()`` (the micro-batches before it left gradients);
        across pipeline ranks always, the stages no longer agree on the next message."""
        if self.failed is None:
            return
        if self.pp.world_size == 1:
            raise StrategyError(
                f"train_step: the last step raised inside its pipeline schedule ({self.failed}), after the "
                "micro-batches before it accumulated their gradients; call opt.zero_grad() on every rank "
                "to skip that batch, then go on"
            )
        raise StrategyError(
            f"train_step: an earlier step raised inside the pipeline schedule on this rank ({self.failed}). "
            "The other pipeline ranks were left waiting for its activations or gradients (or it for "
            "theirs), so the stages no longer agree on the next message and the pipeline cannot go on: "
            "restart from the last checkpoint. To skip a bad batch under a pipeline, let train_step finish "
            "on every rank and decide together after it: if not opt.grads_are_finite() (or not "
            "opt.agree(your_check)), call opt.zero_grad() instead of opt.step()"
        )

    def zero_grad(self) -> None:
        """``opt.zero_grad()``: with one stage per rank, a step whose schedule raised is skipped."""
        if self.pp.world_size == 1:
            self.failed = None

    def check_batch(self, who: str, inputs: Any, targets: Any) -> None:
        m = self.layout.micro_batches
        if not torch.is_grad_enabled():  # every micro-batch's backward would be skipped
            raise StrategyError(
                f"{who}.train_step under torch.no_grad() (or inference_mode): a training step needs "
                "gradients; call it outside the block, and evaluate with model.eval() and model(inputs)"
            )
        for what, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise StrategyError(
                    f"{who}.train_step: {what} must be a batched tensor, got {described(t)}; {ONE_TENSOR}"
                )
            if t.shape[0] % m:
                raise StrategyError(
                    f"{who}.train_step: the batch of {t.shape[0]} samples ({what}) does not split into "
                    f"micro_batches={m} equal micro-batches; use a batch size that is a multiple of {m}"
                )

    def step(
        self,
        who: str,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> torch.Tensor:
        """The schedule on ``(inputs, targets)`` (checked by :meth:`check_batch`), then, unless inside
        ``no_sync()``, the tied weights' sum and the dp reduction; the batch's mean loss on every
        pipeline rank (``who``: the model, named in a refusal; a step after one that raised is refused by
        :meth:`same_on_pp`, before the batch check)."""
        micro_in, micro_tg = inputs.chunk(self.layout.micro_batches), targets.chunk(self.layout.micro_batches)
        specs = self.specs_for(micro_in[0])
        self.tied.before_accumulate()  # gradients kept from the last step: their tie sum counted once
        pp, plan, dp = self.pp, self.schedule, self.dp
        sync = dp.require_backward_grad_sync
        links = StageLinks(pp, plan, specs) if pp.world_size > 1 else None
        calls = {
            s: lambda x, micro, s=s: self.stage_forward(x, s, micro_in[micro])
            for s in plan.stages_of(pp.rank)
        }
        with dp.keep_gathered():  # ZeRO-3/FSDP: each unit gathered once per step
            excluded = {t.untyped_storage().data_ptr() for t in [*dp.module.parameters(), inputs, targets]}
            with dp.no_sync():
                try:
                    result = run_schedule(
                        plan,
                        pp.rank,
                        calls,
                        links,
                        micro_in,
                        micro_tg,
                        loss_fn,
                        excluded,
                        checkpointing=self.checkpointing,
                        modules={s: self.layout.stages[s] for s in plan.stages_of(pp.rank)},
                    )
                except BaseException as exc:
                    self.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
                    raise
            self.last = result
            # parameters no micro-batch used since zero_grad(): refused on every rank of every replica
            # before reducing (with find_unused_parameters they are left out of the step instead)
            checked = sync and not dp.find_unused_parameters
            unused = dp.unused_here() if checked else []
            # a loss without a graph for every micro-batch (the last stage's): known on every pp rank
            loss, counts, graphless = loss_and_counts_over_pp(result.loss, len(unused), pp, result.graphless)
            where, group = f"{who}.train_step on pipeline rank {pp.rank}", dp.dp_backend
            per_rank: dict[Any, int] = dict(enumerate(counts))
            ranks_are = "pipeline rank(s)"
            if checked and group.world_size > 1:  # replicas may disagree (a branch taken on some only)
                per_rank, ranks_are = counts_over_dp(counts, group), "(dp rank, pipeline rank)"
                where += f" of dp rank {group.rank}"
            if sync and not checked and group.world_size > 1:  # find_unused_parameters: refused only
                graphless = _on_every_replica(graphless, group)  # where no replica's loss trains
            if graphless:  # replicas that checked see this one's unused parameters and refuse them
                raise StrategyError(GRAPHLESS_LOSS)
            if any(per_rank.values()):
                dp.check_requires_grad()  # one frozen after wrapping: named as such
                since = "from any micro-batch of this step"
                raise everywhere_unused_error(where, ranks_are, since, unused, per_rank)
            if sync:
                self.tied.before_reduce()
                dp.reduce_accumulated_grads(unused_checked=True)  # checked above, over pp and dp
        return loss[0]


def _on_every_replica(flag: bool, dp: CommunicationBackend) -> bool:
    """Whether ``flag`` holds on every replica (one all-reduce of one value over ``dp``)."""
    buf = torch.tensor([float(flag)], dtype=torch.float32, device=dp.device)
    dp.all_reduce(buf, ReduceOp.MIN)
    return bool(buf.item())
