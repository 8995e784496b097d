"""``Trainer``: runs any (model strategy, optimizer strategy) pair on one rank of a world.

Here: building the run's parts from the config (the run plan, the model and optimizer strategies, the
data feed, the guards), resuming, and the loop (``fit``): steps, evaluation every N steps, early
stopping agreed by all ranks, atomic sharded checkpoints, metrics and a profile. One optimizer step
is ``trainers/step.py``, evaluation ``trainers/evaluation.py``, what ``fit`` returns
``trainers/result.py``.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import save_checkpoint
from dtlab.checkpoint.files import check_json, step_dir_name
from dtlab.checkpoint.load import LoadedCheckpoint
from dtlab.config import TrainConfig, check_world_size
from dtlab.errors import CheckpointError, ConfigError
from dtlab.lr_schedule import build_scheduler, check_run_length
from dtlab.models.base import OptimizerTarget
from dtlab.optimizers.elastic import ElasticMember
from dtlab.optimizers.grad_scaler import DynamicLossScaler, refuse_float16
from dtlab.parallel_config import run_plan
from dtlab.trainers.arguments import check_arguments
from dtlab.trainers.build import build_model, build_optimizer_strategy, precision_policy
from dtlab.trainers.custom import task_from_objects
from dtlab.trainers.elastic import (
    commit_on_stop,
    end_step,
    report_restore,
    restore_commit,
    wrap_elastic,
)
from dtlab.trainers.evaluation import evaluate
from dtlab.trainers.feed import DataFeed
from dtlab.trainers.guard import EarlyStopping, NonFiniteGuard
from dtlab.trainers.ownership import hold_checkpoint_dir
from dtlab.trainers.parallel import parallel_loss
from dtlab.trainers.preemption import StopRequest, preempt
from dtlab.trainers.preflight import check_paths_on_every_rank
from dtlab.trainers.profiler import Profiler
from dtlab.trainers.progress import ProgressBar
from dtlab.trainers.rank_draws import RankDraws
from dtlab.trainers.report import format_record, header, log_skipped, step_record, summary_rows, write_profile
from dtlab.trainers.result import TrainResult
from dtlab.trainers.resume import (
    choose_checkpoint,
    foreign_steps_note,
    owned_steps,
    report_resume,
    restore_agreed,
)
from dtlab.trainers.rundir import open_metrics
from dtlab.trainers.saved_state import check_saved_state
from dtlab.trainers.scheduler import (
    LRSchedulerLike,
    SchedulerFactory,
    check_scheduler,
    check_scheduler_factory,
    scheduler_state,
)
from dtlab.trainers.state import capture_rng, restore_rng, trainer_state
from dtlab.trainers.step import train_step
from dtlab.trainers.tasks import Task, build_task, check_task, cross_entropy_loss
from dtlab.trainers.token_mean import token_mean_for

__all__ = ["SchedulerFactory", "TrainResult", "Trainer"]

_FP16_FIX = (
    "Build the model in float32 (no .half(): train.precision=fp16 computes under float16 autocast over "
    "float32 parameters), or set train.precision=bf16"
)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        backend: CommunicationBackend,
        task: Task | None = None,
        scheduler_factory: SchedulerFactory | None = None,
        member: ElasticMember | None = None,
        stop: StopRequest | None = None,
        *,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
        train_data: Any = None,
        eval_data: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | str | None = None,
    ) -> None:
        """``member``: this rank's place in an elastic job (``dtlab.testing.elastic.run_elastic``
        passes one); with ``elastic.commit_every`` the optimizer strategy is wrapped in an
        ElasticOptimizer and the last commit is restored here (docs/elastic.md). ``stop``: checked at
        every step boundary (one all-reduce per step); once set on any rank, every rank stops after the
        same step with a final checkpoint (see ``trainers/preemption.py``).

        Your own model and data: ``model`` (an ``nn.Module``, copied per rank, or a function building
        one), ``train_data`` (any map-style torch ``Dataset`` of ``(input, target)``), ``eval_data``
        (default: the last ``data.eval_fraction`` of ``train_data``) and ``loss_fn`` (a function of
        ``(output, target)``, or ``"cross_entropy"`` / ``"mse"``; default cross entropy) instead of
        ``task``."""
        check_arguments("Trainer", config, task, stop, backend)
        check_world_size(config, backend.world_size)
        check_paths_on_every_rank(config, backend)  # not at the first save, after hours of training
        self.config, self.backend = config, backend
        self.stop = stop
        self.run_id = uuid.uuid4().hex
        #: the lock on checkpoint.dir: a second run on it is refused here, before any work
        self.dir_hold = hold_checkpoint_dir(config, backend, self.run_id)
        try:
            self._setup(task, scheduler_factory, member, model, train_data, eval_data, loss_fn)
        except BaseException:
            self.dir_hold.release()
            raise
        weakref.finalize(self, self.dir_hold.release)  # a Trainer dropped without fit()

    def _setup(
        self,
        task: Task | None,
        scheduler_factory: SchedulerFactory | None,
        member: ElasticMember | None,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
        train_data: Any,
        eval_data: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | str | None,
    ) -> None:
        config, backend = self.config, self.backend
        self.is_main = backend.rank == 0
        if model is not None or train_data is not None:
            if task is not None:
                raise TypeError("Trainer: pass either task or model/train_data/eval_data/loss_fn, not both")
            task = task_from_objects(config, model, train_data, eval_data, loss_fn)
        self.task = task or build_task(config)
        check_task(config, self.task, backend.world_size)
        #: the run plan (mesh sizes, data-parallel strategy, tensor plan, schedule), built once here
        self.plan = run_plan(config, backend.world_size)
        #: compute, gradient-reduction and output dtypes (the strategies reduce in its reduce_dtype)
        self.precision = precision_policy(config)
        # on meta or plainly (model.init), model.pretrained loaded
        built = build_model(config, backend, self.task, self.plan, self.precision)
        self.model, self.num_parameters, self.construction = (
            built.model,
            built.num_parameters,
            built.construction,
        )
        #: the task's loss, or a tensor-parallel model's vocabulary-parallel cross entropy
        self.loss_fn = parallel_loss(self.model, self.task.loss_fn, cross_entropy_loss, config.parallel.tp)
        self.optimizer = build_optimizer_strategy(config, self.model)
        self.elastic = wrap_elastic(config, self.optimizer, member)
        if self.elastic is not None:
            self.optimizer = self.elastic
        local_opt = self.optimizer.optimizer
        #: stepped once per applied optimizer step; a scheduler_factory's value is checked here
        self.scheduler: LRSchedulerLike
        if scheduler_factory is not None:
            check_scheduler_factory(scheduler_factory)
            self.scheduler = check_scheduler(scheduler_factory(local_opt))
            # the config's own scheduler was checked with the config (check_torch_scheduler)
            check_run_length(self.scheduler, config.train.steps, "scheduler_factory")
        else:
            self.scheduler = build_scheduler(local_opt, config.optimizer, config.train.steps)
        if config.checkpoint.dir is not None:  # refuse now, not at the first save after hours of training
            check_json(
                scheduler_state(self.scheduler), f"the LR scheduler's state ({type(self.scheduler).__name__})"
            )
        d = config.data
        # data and the loss follow the model's data-parallel group (ranks of one dp group share a
        # batch's shards); consensus (agree, finite checks) spans model.world_backend
        self.dp = self.model.dp_backend
        #: in-memory ranks: each one's training draws (dropout) from a generator of its own
        self.draws = RankDraws(config.train.seed, backend.rank, config.parallel.tp, self.model)
        self.feed = DataFeed(
            self.task.train_data,
            d.global_batch_size,
            self.dp.world_size,
            self.dp.rank,
            d.accumulation_steps,
            seed=config.train.seed,
            shuffle=d.shuffle,
            device=backend.device,
            num_workers=d.num_workers,
            pin_memory=d.pin_memory,
            threads=self.draws.on,  # in-memory ranks: the samples' draws seeded, as in workers
        )
        #: the default loss as the mean over the global batch's counted targets (None: a loss of your own)
        self.token_mean = token_mean_for(
            self.task.loss_fn, self.task.train_data, backend, self.dp, d.accumulation_steps, self.plan
        )
        self.guard = NonFiniteGuard(config.train.max_nonfinite_steps)
        self.early = EarlyStopping(
            config.train.early_stopping_patience, config.train.early_stopping_min_delta
        )
        self.profiler = Profiler(backend.stats)
        self.step = 0
        self.start_step = 0
        #: fp16: dynamic loss scaling agreed by every rank (optimizers/grad_scaler.py)
        self.scaler = DynamicLossScaler() if config.train.precision == "fp16" else None
        self.overflow_steps: list[int] = []
        if self.scaler is not None and not callable(getattr(self.model, "scale_grads_", None)):
            raise ConfigError(
                f"train.precision=fp16 needs a model strategy that can unscale its gradients "
                f"(scale_grads_); {type(self.model).__name__} cannot: use bf16"
            )
        # the same refusal as GradScaler's (and torch's), agreed on every rank
        if self.scaler is not None and isinstance(self.model, OptimizerTarget):
            refuse_float16(self.optimizer, self.model, "train.precision=fp16", _FP16_FIX)
        self._recorded_run_dir: str | None = None  # the run directory a resumed checkpoint's run wrote
        self.resumed_from: str | None = None
        self.resume_notes: list[str] = []
        #: step directories this run may prune or replace: the ones it continues and the ones it wrote
        self.owned_steps: set[str] = set()
        if config.checkpoint.resume:
            self._resume()
        self.dir_hold.settle_latest()  # a latest that is not a file: moved aside now, not at the first save
        self.resume_notes = self.dir_hold.notes + self.resume_notes
        if self.is_main and config.checkpoint.dir is not None and not self.owned_steps:
            note = foreign_steps_note(config, self.owned_steps)
            if note:
                self.resume_notes.append(note)
        restore_commit(self.elastic, self)  # elastic: the last commit, newer than any checkpoint
        #: this run's directory (a fresh one per run; a resume continues its own): trainers/rundir.py
        self.run_dir, self.metrics = open_metrics(
            config, backend, self.start_step > 0, self._recorded_run_dir
        )
        if self.is_main:
            report_resume(self.metrics, self.resumed_from, self.resume_notes, self.start_step)
        report_restore(self)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[bool, float | None, float | None]:
        """One optimizer step; returns (applied, mean loss over the dp group, global gradient norm)
        (trainers/step.py)."""
        return train_step(self)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and accuracy for classification) over held-out data, the same on every rank
        (trainers/evaluation.py)."""
        return evaluate(self)

    # ------------------------------------------------------------------ checkpoints
    def resume_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the Trainer itself (step, schedule, guards, data position)."""
        return trainer_state(self, self.config, self.run_id, self.resumed_from, self.run_dir)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's RNG states: torch's, Python's, NumPy's and an in-memory rank's own generator."""
        return {**capture_rng(self.backend.device), **self.draws.state()}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        restore_rng(state, self.backend.device)
        self.draws.load(state)

    def save_checkpoint(self) -> Path:
        c = self.config.checkpoint
        if c.dir is None:
            raise CheckpointError("checkpoint.dir is not set; set it to save checkpoints")
        with self.profiler.phase("checkpoint"):
            path = save_checkpoint(
                c.dir,
                self.step,
                self.backend,
                self.model.sharded_state_dict(),
                self.optimizer.sharded_state_dict(),
                self.rank_state(),
                self.resume_state(),
                keep_last=c.keep_last,
                owned=self.owned_steps,
                run_tag=self.run_id[:8],
            )
        self.owned_steps.add(step_dir_name(self.step))  # this run wrote it: its own to replace or prune
        return path

    def _resume(self) -> None:
        def check(ckpt: LoadedCheckpoint) -> None:  # a saved state this Trainer cannot take is corrupt
            check_saved_state(self, ckpt.meta, ckpt.step, str(ckpt.path / "meta.json"))

        chosen = choose_checkpoint(self.config, self.backend, self.dir_hold.previous, check)
        self.resume_notes = chosen.notes
        if chosen.checkpoint is None:
            return  # nothing saved yet: a fresh start
        self.resume_notes = self.resume_notes + restore_agreed(self, chosen.checkpoint) + self.feed.notes
        self.resumed_from = str(chosen.checkpoint.path)
        if self.config.checkpoint.dir is None:  # resumed from a path: the steps it trains would be lost
            self.resume_notes.append(
                f"checkpoint.dir is unset: this run saves no checkpoint of the steps it trains after "
                f"{chosen.checkpoint.step}; set checkpoint.dir to keep them"
            )
        run = chosen.checkpoint.meta.get("run")
        recorded = run.get("run_dir") if isinstance(run, dict) else None
        self._recorded_run_dir = recorded if isinstance(recorded, str) else None
        self.owned_steps = owned_steps(self.config, chosen.checkpoint)
        self.dir_hold.record_resume(chosen.checkpoint)

    def close(self) -> None:
        """Close the process groups of the mesh a model-parallel run built (collective; the world
        backend itself belongs to whoever made it)."""
        mesh = getattr(self.model, "mesh", None)
        if mesh is not None:
            mesh.close()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        cfg = self.config
        result = TrainResult(
            start_step=self.step,  # the resumed step on the first fit(); where the last one stopped after
            rank=self.backend.rank,
            resumed_from=self.resumed_from,
            resume_notes=list(self.resume_notes),
        )
        bar = ProgressBar(cfg.train.steps, enabled=self.is_main and cfg.logging.progress, initial=self.step)
        window: dict[str, float] = {"t": time.perf_counter(), "steps": 0, "comm": self.backend.stats.seconds}
        sent0 = self.backend.stats.bytes_sent
        logged = 0  # result.losses already in a metrics record
        if self.is_main and cfg.logging.progress:
            bar.print_line(header(self))
        t_start = time.perf_counter()
        if self.metrics.closed:  # an earlier fit() ended (or raised): this one appends to the run's files
            recorded = None if self.run_dir is None else str(self.run_dir)
            self.run_dir, self.metrics = open_metrics(cfg, self.backend, True, recorded)
        self.model.train()
        self.dir_hold.acquire()  # again when an earlier fit() released it
        if self.stop is not None:  # an exit on a repeated signal releases the lock first
            self.stop.add_cleanup(self.dir_hold.release)
        try:
            while self.step < cfg.train.steps:
                applied, loss, norm = self.train_step()
                self.step += 1
                window["steps"] += 1
                if applied and loss is not None:
                    result.losses.append((self.step, loss))
                elif not applied:
                    log_skipped(self, bar)
                stop = False
                ev = cfg.train.eval_every
                if ev and (self.step % ev == 0 or self.step == cfg.train.steps):
                    with self.profiler.phase("eval"):
                        ev_result = self.evaluate()
                    result.evals.append((self.step, ev_result))
                    self.metrics.log({"step": self.step, **ev_result})
                    stop = self.optimizer.agree(self.early.update(ev_result["eval_loss"]))
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps or stop:
                    recent, logged = result.losses[logged:], len(result.losses)  # every step's loss
                    rec = self.metrics.log(step_record(self, window, loss, norm, recent))
                    if self.is_main and cfg.logging.progress:
                        bar.print_line(format_record(rec))
                    window = {"t": time.perf_counter(), "steps": 0, "comm": self.backend.stats.seconds}
                last = loss if loss is not None else (result.losses[-1][1] if result.losses else None)
                bar.update(self.step, "" if last is None else f"loss {last:.4f}", force=stop)
                ck = cfg.checkpoint
                if ck.dir and (
                    (ck.every and self.step % ck.every == 0) or self.step == cfg.train.steps or stop
                ):
                    result.checkpoint = str(self.save_checkpoint())
                end_step(self)  # elastic: commit when due; the member may leave the world here
                if stop:
                    result.stopped_early = True
                    break
                if (
                    self.stop is not None
                    and self.step < cfg.train.steps
                    and preempt(self, self.stop, result, bar)
                ):
                    commit_on_stop(self)  # elastic: a restart after this stop redoes nothing
                    break
        finally:
            bar.close()
            self.metrics.close()
            self.dir_hold.release()
            if self.stop is not None:
                self.stop.remove_cleanup(self.dir_hold.release)
        result.final_step = self.step
        result.skipped_steps = list(self.guard.skipped_steps)
        result.profile = self.profiler.summary()
        result.summary = summary_rows(self, result, time.perf_counter() - t_start, sent0)
        result.run_dir = None if self.run_dir is None else str(self.run_dir)
        write_profile(self, result)
        return result
