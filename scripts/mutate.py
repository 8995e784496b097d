#!/usr/bin/env python
"""Mutation testing for dtlab's core: plant one small bug at a time, run the tests that should notice.

For each source file of the core (backends, models, optimizers, compression, checkpoint, the trainer
step) the script finds the usual mutation sites inside function bodies with :mod:`ast`:

- ``cmp``: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``in`` <-> ``not in``, ``is`` <-> ``is not``
- ``arith``: ``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``*``, and the same for ``+=``, ``-=``, ``*=``
- ``const``: an integer ``n`` -> ``n + 1``, a float ``x`` -> ``2 x`` (``0.0`` -> ``1.0``),
  ``True`` <-> ``False``
- ``bool``: ``and`` <-> ``or``, ``not x`` -> ``x``, ``-x`` -> ``x``
- ``range``: ``range(n)`` -> ``range(n - 1)``
- ``inplace``: ``add_`` -> ``copy_``, ``sub_`` -> ``add_``, ``mul_`` -> ``div_``, ``zero_`` -> ``clone``
- ``stmt``: a call statement (``backend.all_reduce(buf)``, ``buf.zero_()``, ...) deleted

Not mutated: module-level code (constants, tuning knobs), docstrings, f-strings, ``raise`` statements,
``if`` tests whose body only raises (input validation: its own tests check the messages), logging,
default argument values and annotations. Mutants that do not compile are dropped.

Each mutant is written into a private copy of the repository and the file's test subset (``TESTS``
below: a few fast in-memory tests chosen per file, see ``--list``) is run with a timeout; a failing or
timed-out run kills the mutant, a passing run lets it survive. ``--per-file`` caps the mutants per file
(a seeded sample, so a rerun draws the same ones). Survivors listed in ``ACCEPTED`` (equivalent
mutants, with the reason) are reported apart. Not part of the test suite: run it by hand, e.g.

    python scripts/mutate.py --per-file 6 --jobs 2 --json mutation.json

``--since REV`` keeps only the sites on lines added or changed since the git revision ``REV`` (the
``+`` side of ``git diff -U0 REV``): every mutant of new code, e.g. ``--since main~5 --per-file 0``.

Exit status 0 when the kill rate (accepted survivors count as killed) is at least ``--min-rate``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_PARITY = "tests/test_strategies_parity.py::test_parity_in_memory"
_ACCUM = "tests/test_accumulation_scale.py::test_every_strategy_accumulates_at_the_right_scale"
_SHARDS = "tests/test_boundaries.py::test_strategies_on_one_element_empty_and_uneven_shards"
_SPARSE = ["tests/test_compression_algorithms.py", "tests/test_boundaries.py"]
_STRATEGY = [
    _ACCUM,
    _PARITY,
    _SHARDS,
    "tests/test_unit_plans.py",
    "tests/test_strategies_semantics.py",
    "tests/test_strategies_features.py",
    "tests/test_strategies_units.py",
]
#: a step that raises and is caught (the dp strategies, then composed with tensor parallelism and pipelines)
_RAISED = ["tests/test_strategies_raised_steps.py", "tests/test_hybrid_raised_steps.py"]
_DP = [
    *_RAISED,
    *_STRATEGY,
    "tests/test_compression_strategies.py::test_reduce_accumulated_grads_starts_a_step_of_the_reducer",
    "tests/test_hybrid_parity.py::test_cube_parity_both_optimizers",  # the post-sync hooks of a composition
]
_ENGINE = ["tests/test_conformance_inmemory.py::test_every_check_passes_on_the_inmemory_backend"]
_ENGINE += ["tests/test_inmemory_world.py"]
_CKPT = ["tests/test_crash_points.py", "tests/test_checkpoint_io.py", "tests/test_faults_resume.py"]
_TRAINER = [
    "tests/test_accumulation_scale.py::test_trainer_accumulation_keeps_the_gradient_scale",
    "tests/test_trainer.py",
    "tests/test_mixed_precision.py",
    "tests/test_faults_resume.py",
]

#: tensor parallelism: the in-memory parity runs first, then the layers, split logits, ties and checks
_TENSOR = [
    "tests/test_tensor_parity.py::test_parity_in_memory",
    "tests/test_tensor_layers.py",
    "tests/test_tensor_layer_edges.py",
    "tests/test_split_logits.py",
    "tests/test_tied_weights.py",
    "tests/test_tensor_checks.py",
    "tests/test_tensor_same_grads.py",
    "tests/test_tensor_module_types.py",
    "tests/test_hf_attentions.py",
    "tests/test_tensor_checkpoint.py",
    "tests/test_hf_cli.py::test_a_plan_the_config_cannot_use_is_refused_before_any_rank_starts",
]
#: Hugging Face models' own plans and plan="auto" at tp2 (fused projections, scaled embeddings, Conv1D)
_HF_TP = [
    "tests/test_hf_families.py",
    "tests/test_hf_parallel.py::test_plan_auto_matches_one_process",
    "tests/test_hf_parallel.py::test_what_auto_cannot_honour_is_refused_before_any_call",
    "tests/test_hf_parallel.py::test_a_fused_section_split_along_dim_1_is_flattened_in_local_order",
    "tests/test_tensor_layers.py",
    "tests/test_tensor_layer_edges.py",
    "tests/test_tensor_checks.py::test_plan_errors_name_module_size_and_tp",
    "tests/test_hf_adapters.py",
]
#: pipelines: every schedule's in-memory parity, then the stage communication, the model, ties
_PIPELINE = [
    "tests/test_pipeline_parity.py::test_parity_in_memory",
    "tests/test_pipeline_parity.py::test_parity_dp2_x_pp2_in_memory",
    "tests/test_pipeline_parity.py::test_parity_transformer_lm",
    "tests/test_pipeline_comm.py",
    "tests/test_pipeline_model.py",
    "tests/test_pipeline_split_refusals.py",
    "tests/test_pipeline_checkpointing.py",
    "tests/test_pipeline_tied_accumulation.py",
    "tests/test_custom_model_pipeline.py",
    "tests/test_pipeline_aux_output.py",
    "tests/test_model_parallel_edges.py",
]
#: the composition: the cube's parity, meta construction, ties, tp gradients, checks and checkpoints
_COMPOSE = [
    "tests/test_hybrid_parity.py::test_cube_parity_both_optimizers",
    "tests/test_hybrid_parity.py::test_parity_other_strategies_schedules_and_meshes",
    "tests/test_tensor_parity.py::test_parity_in_memory",
    "tests/test_pipeline_parity.py::test_parity_dp2_x_pp2_in_memory",
    "tests/test_meta_parallel.py",
    "tests/test_tied_weights.py",
    "tests/test_pipeline_tied_accumulation.py",
    "tests/test_tensor_same_grads.py",
    "tests/test_partial_grads_kept.py",
    "tests/test_hybrid_checks.py",
    "tests/test_hybrid_checkpoint.py",
    "tests/test_model_parallel_refusals.py",
    "tests/test_model_parallel_edges.py",
    "tests/test_sparse_complex.py",
    "tests/test_tensor_grad_before_wrapping.py",
    "tests/test_tensor_layer_edges.py",
]
_META = [
    "tests/test_meta_parallel.py",
    "tests/test_meta_init.py",
    "tests/test_meta_bool_buffers.py",
    "tests/test_hybrid_parity.py::test_cube_parity_both_optimizers",
    "tests/test_model_parallel_edges.py",
]
_PLACED = [
    "tests/test_hybrid_checkpoint.py",
    "tests/test_tensor_checkpoint.py",
    "tests/test_pipeline_model.py::test_checkpoint_pp4_loads_at_pp2_into_ddp_and_the_plain_module",
    "tests/test_meta_parallel.py",
    "tests/test_model_parallel_edges.py",
]

#: the core files and the tests run against each file's mutants (fast, in-memory, most relevant first)
TESTS: dict[str, list[str]] = {
    "dtlab/models/tensor/_layers.py": _TENSOR,
    "dtlab/models/tensor/_comm.py": _TENSOR,
    "dtlab/models/tensor/_split_logits.py": _TENSOR,
    "dtlab/models/tensor/_fused.py": _HF_TP,
    "dtlab/models/tensor/_attentions.py": _TENSOR,
    "dtlab/models/tensor/_plan.py": _TENSOR,
    "dtlab/models/tensor/_sources.py": _HF_TP,
    "dtlab/models/pipeline/_runtime.py": _PIPELINE,
    "dtlab/models/pipeline/_comm.py": _PIPELINE,
    "dtlab/models/pipeline/_split.py": _PIPELINE,
    "dtlab/models/pipeline/_zb.py": _PIPELINE,
    "dtlab/models/pipeline/_ties.py": _PIPELINE,
    "dtlab/models/compose/_build.py": _COMPOSE,
    "dtlab/models/compose/hybrid.py": _COMPOSE,
    "dtlab/models/compose/_tp_grads.py": _COMPOSE,
    "dtlab/models/compose/_tied.py": _COMPOSE,
    "dtlab/models/compose/_meta_walk.py": _META,
    "dtlab/models/compose/single_axis.py": _COMPOSE,
    "dtlab/models/placed_state.py": _PLACED,

    "dtlab/backends/_inmemory_ops.py": _ENGINE,
    "dtlab/backends/inmemory.py": _ENGINE,
    "dtlab/backends/_inmemory_rendezvous.py": _ENGINE,
    "dtlab/models/dp/ddp.py": _DP,
    "dtlab/models/dp/zero2.py": _DP,
    "dtlab/models/dp/zero3.py": _DP,
    "dtlab/models/dp/fsdp.py": _DP,
    "dtlab/models/dp/flat.py": _STRATEGY,
    "dtlab/models/dp/data_parallel.py": _DP,
    "dtlab/models/dp/_sharded.py": _DP,
    "dtlab/models/dp/_sharded_units.py": _DP,
    "dtlab/core/shard_index.py": _STRATEGY,
    "dtlab/optimizers/zero1.py": _STRATEGY,
    "dtlab/optimizers/_sharded.py": _STRATEGY,
    "dtlab/optimizers/ddp.py": _STRATEGY,
    "dtlab/optimizers/elastic.py": ["tests/test_elastic_crash_points.py", "tests/test_elastic.py"],
    "dtlab/core/backward.py": [
        "tests/test_strategies_raised_steps.py",
        "tests/test_async_sgd_raised.py",
        "tests/test_compression_strategies.py::test_reduce_accumulated_grads_starts_a_step_of_the_reducer",
    ],
    "dtlab/compression/reducer.py": [
        "tests/test_strategies_raised_steps.py",
        "tests/test_compression_raised_steps.py",
        "tests/test_compression_strategies.py",
        "tests/test_compression_momentum.py",
    ],
    "dtlab/compression/sparse.py": _SPARSE,
    "dtlab/compression/oktopk.py": _SPARSE,
    "dtlab/compression/topka.py": _SPARSE,
    "dtlab/compression/topkdsa.py": _SPARSE,
    "dtlab/compression/gtopk.py": _SPARSE,
    "dtlab/compression/gaussiank.py": _SPARSE,
    "dtlab/compression/error_feedback.py": [*_SPARSE, "tests/test_compression_momentum.py"],
    "dtlab/checkpoint/save.py": _CKPT,
    "dtlab/checkpoint/resume.py": _CKPT,
    "dtlab/checkpoint/load.py": _CKPT,
    "dtlab/trainers/trainer.py": _TRAINER,
    "dtlab/trainers/step.py": _TRAINER,
    "dtlab/trainers/evaluation.py": _TRAINER,
    "dtlab/trainers/scheduler.py": ["tests/test_trainer_scheduler.py", "tests/test_trainer_parts.py"],
    "dtlab/models/pipeline/_schedules.py": [
        "tests/test_model_parallel_refusals.py",
        "tests/test_pipeline_schedules.py",
        "tests/test_advise.py",
    ],
    "dtlab/models/compose/_pipelined.py": [
        "tests/test_hybrid_raised_steps.py",
        "tests/test_hybrid_checks.py",
    ],
    "dtlab/models/tensor/_agree.py": ["tests/test_tensor_same_batch.py"],
    "dtlab/models/dp/_sync_bn.py": ["tests/test_sync_batchnorm.py"],
    "dtlab/models/dp/_writes.py": ["tests/test_param_writes.py", "tests/test_param_pruning.py"],
    "dtlab/core/broadcast.py": ["tests/test_buffer_broadcast.py", "tests/test_sparse_complex.py"],
    "dtlab/optimizers/grad_scaler.py": ["tests/test_grad_scaler.py"],
    "dtlab/models/base.py": ["tests/test_converted_after_wrapping.py", "tests/test_ema_copy.py"],
    "dtlab/trainers/feed.py": [
        "tests/test_accumulation_scale.py::test_trainer_accumulation_keeps_the_gradient_scale",
        "tests/test_trainer_parts.py",
        "tests/test_boundaries.py::test_feed_counts_epochs_at_their_boundary",
    ],
}

#: slow tests of those files left out of every run (spawned processes, a real SIGKILL, the CLI default)
DESELECT = [
    "tests/test_elastic.py::test_mpi_is_refused_up_front_with_the_reason",
    "tests/test_checkpoint_io.py::test_sigkill_while_saving_leaves_previous_checkpoint_loadable",
    "tests/test_trainer.py::test_cli_default_shortened_trains_and_writes_clean_metrics",
]

#: equivalent mutants, ``path:operator:the line before`` (lines move) -> why no test can tell them apart
ACCEPTED: dict[str, str] = {
    "dtlab/models/tensor/_agree.py:arith:total, weighted = total + sums.sum(), weighted + dots.sum()": (
        "the plain checksum negated: every rank computes the same function of its bits, so equal batches "
        "still give equal numbers and a changed word still changes them (the comparison is equality)"
    ),
    "dtlab/core/broadcast.py:const:for t, part in zip(same, flat.split([t.numel() for t in same]), strict=True):": (  # noqa: E501 (the line's text, matched exactly)
        "zip(..., strict=False): the parts are split by the tensors' own sizes, so the lengths always agree"
    ),
    "dtlab/models/base.py:const:self._params = [(n, p, p.new_empty(0)) for n, p in module.named_parameters()]": (  # noqa: E501 (the line's text, matched exactly)
        "new_empty(1): only the probe's dtype and device are read, never its size"
    ),
    "dtlab/models/base.py:stmt:probed.add((p.dtype, p.device))": (
        "a cache of the (dtype, device) pairs already probed: without it each parameter is probed again, "
        "with the same answer"
    ),
    "dtlab/models/base.py:const:was = torch.empty(0, dtype=p.dtype, device=p.device)": (
        "empty(1): the conversion is probed for the dtype and device it gives, not the size"
    ),
    "dtlab/backends/_inmemory_ops.py:const:reach = [0, 0]  # the furthest end seen so far of an output span and of an input span": (  # noqa: E501 (the line's text, matched exactly)
        "reach starts at [0, 1] instead of [0, 0]: the reach is compared with memory addresses "
        "(data_ptr), which are never below 1, so the first span is never taken for an overlap either way"
    ),
    "dtlab/core/shard_index.py:arith:n += 1": (
        "n -= 1 numbers the extra pieces of one tensor #-1, #-2, ... instead of #1, #2, ...: the "
        "names only need to be unique, readers go by each entry's 'key'"
    ),
    "dtlab/optimizers/_sharded.py:const:for t, unit in zip(self._tensors, self._units, strict=True):": (
        "zip(..., strict=False): the shard tensors and the units are built together, one per unit, so "
        "the lengths always agree and strict never fires"
    ),
    "dtlab/compression/error_feedback.py:stmt:self._spares.clear()": (
        "load_state keeps the scratch buffers: each is overwritten by the next accumulate before it is "
        "read, and update accepts only the buffer accumulate has just returned"
    ),
    "dtlab/compression/gaussiank.py:const:loops = 0": (
        "NOT equivalent, accepted: the adjustment budget (50 steps of 1.2%) one step shorter; it "
        "differs only when the threshold needs all 50 steps, and the selection is valid either way"
    ),
    "dtlab/models/dp/data_parallel.py:const:self._backward_synced = False  # whether the last backward started synchronized": (  # noqa: E501
        "the initial value is never read: _backward_synced is read only after a backward that began "
        "and raised, and _begin_backward sets it right after beginning that backward"
    ),
    "dtlab/models/dp/data_parallel.py:const:self._guarded = False": (
        "_guarded left True makes the next forward run _release_guards again, which only drops "
        "ShardedGradient stand-ins (zero_grad just replaced them, _release_guards just dropped them) or, "
        "under DDP and ZeRO-1 with all_reduce, points param.grad at the bucket views it already is"
    ),
    "dtlab/models/dp/ddp.py:const:for unit, flat in zip(self._units, self._data, strict=True):": (
        "zip(..., strict=False): _data is built from _units on the line above, one flat buffer per "
        "unit, so the lengths always agree and strict never fires"
    ),
    "dtlab/models/dp/_sharded.py:stmt:self._free_all()": (
        "in _abandon_backward: after a backward that raised, everything but an evaluation forward is "
        "refused until zero_grad(), which runs _free_all itself outside a backward, and an evaluation "
        "forward gathers and frees each unit itself (parameters at rest after it either way)"
    ),
    "dtlab/models/dp/_sharded_units.py:cmp:if st is not self.unjoined or st.work is None:": (
        "NOT equivalent, accepted: the unit left unjoined (a watched gather the other ranks did not "
        "join within forward_wait_s) always has its gather pending, so 'work is not None' frees it, "
        "waiting for the late rank's gather. Only a real engine has such a gather (the in-memory one "
        "completes at once); checked by hand on Gloo: rank 0 evaluating alone gets the error after "
        "6.0 s (when the other rank rejoins) instead of 3.0 s, inside test_all_habits_on_gloo's "
        "10 s bound, which leaves room for load"
    ),
    "dtlab/models/tensor/_attentions.py:const:return known > 0 and whole % known == 0": (
        "known > 1: the other dims multiplying to 1 (view(1, -1), view(-1)) fit any input, so torch "
        "raises no view error to read there"
    ),
    "dtlab/models/pipeline/_comm.py:arith:if s + 1 < n and schedule.rank_of(s + 1) != me:": (
        "rank_of(s - 1): stages are placed round-robin (rank_of(s) = s % p), so stage s - 1 is on this "
        "rank exactly when stage s + 1 is (p = 1, or never for p >= 2)"
    ),
    "dtlab/models/pipeline/_split.py:const:return cls(specs[0].shape, specs[0].dtype, specs, marked)": (
        "specs[1].dtype: a TupleSpec only describes the last stage's output, whose items are read one by "
        "one (never sent as one message), so its own shape and dtype fields are never read"
    ),
    "dtlab/models/pipeline/_ties.py:const:for tie, g in zip(ties, grads, strict=True):": (
        "zip(..., strict=False): both callers build grads from the ties list itself, one per tie, so "
        "the lengths always agree and strict never fires"
    ),
    "dtlab/models/compose/_tp_grads.py:const:self._summed = False  #: whether the gradients may hold a sum over tp since the last zero_grad()": (  # noqa: E501 (the line's text, matched exactly)
        "starting True makes the first forward zero the partial gradients on tp ranks > 0, which hold "
        "nothing yet: swap_layers drops a gradient left from before wrapping there (counted once, on tp "
        "rank 0)"
    ),
    "dtlab/models/compose/_tied.py:const:self._summed = False  #: whether the copies' gradients may hold their sum since the last step began": (  # noqa: E501 (the line's text, matched exactly)
        "starting True makes the first step zero the tied copies' gradients on the tie group's ranks > 0, "
        "which hold nothing yet: init_ties drops a gradient left from before wrapping there"
    ),
    "dtlab/models/compose/_meta_walk.py:cmp:if asking is not None and asking is entry.module and self._own_values(i):": (  # noqa: E501 (the line's text, matched exactly)
        "'asking is None and asking is entry.module' is never true, so ZeRO-3/FSDP's fast path (the "
        "module initialized in the strategy's buffer) is never taken: the general path draws the same "
        "numbers in the same order and copies them in (bitwise the same model, test_meta_parallel)"
    ),
    "dtlab/models/compose/_meta_walk.py:cmp:if target.module is not entry.module or target.name != n or isinstance(target.placement, Shard):": (  # noqa: E501 (the line's text, matched exactly)
        "'target.name == n' turns the same fast path off for every tensor kept under its own name (the "
        "general path gives the same values); it differs only for a module holding one tensor under two "
        "names, which named_parameters lists once"
    ),
    "dtlab/backends/_inmemory_ops.py:const:results = [torch.empty_like(outs[0]) for _ in outs]": (
        "empty_like(outs[1]) instead of outs[0]: every rank's output has the same number of elements "
        "and dtype (the collective's signature, compared across ranks) and is flattened, so the "
        "scratch buffers are identical"
    ),
}

_CMP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
_INPLACE = {"add_": "copy_", "sub_": "add_", "mul_": "div_", "zero_": "clone"}


@dataclass
class Mutant:
    path: str
    line: int
    op: str
    before: str
    after: str
    status: str = "pending"  # killed | survived | timeout | accepted
    seconds: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.op}"

    @property
    def text_key(self) -> str:
        return f"{self.path}:{self.op}:{self.before}"


@dataclass
class _Site:
    node: ast.AST
    op: str
    replacement: str


def _skipped_ranges(tree: ast.AST) -> list[tuple[int, int]]:
    """Line ranges never mutated: raises, validation ifs, logging, asserts, docstrings."""
    out = []
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if isinstance(node, ast.Raise | ast.Assert):
            out.append((node.lineno, end or node.lineno))
        elif (
            isinstance(node, ast.If) and all(isinstance(s, ast.Raise) for s in node.body) and not node.orelse
        ):
            out.append((node.lineno, end or node.lineno))
        elif isinstance(node, ast.Call) and "log" in ast.unparse(node.func).lower():
            out.append((node.lineno, end or node.lineno))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            out.append((node.lineno, end or node.lineno))
    return out


def _mutations(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(operator, mutated copy) for one node."""
    out: list[tuple[str, ast.AST]] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
        compare = copy.deepcopy(node)
        compare.ops = [_CMP[type(node.ops[0])]()]
        out.append(("cmp", compare))
    elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _ARITH:
        arith = copy.deepcopy(node)
        arith.op = _ARITH[type(node.op)]()
        out.append(("arith", arith))
    elif isinstance(node, ast.Constant) and isinstance(node.value, int | float):  # bool is an int
        v = node.value
        new = (not v) if isinstance(v, bool) else (v + 1 if isinstance(v, int) else (v * 2 if v else 1.0))
        out.append(("const", ast.Constant(new)))
    elif isinstance(node, ast.BoolOp):
        boolop = copy.deepcopy(node)
        boolop.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append(("bool", boolop))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        out.append(("bool", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id == "range" and len(node.args) == 1:
            call = copy.deepcopy(node)
            call.args = [ast.BinOp(call.args[0], ast.Sub(), ast.Constant(1))]
            out.append(("range", call))
        if isinstance(f, ast.Attribute) and f.attr in _INPLACE:
            func = ast.Attribute(copy.deepcopy(f.value), _INPLACE[f.attr], ast.Load())
            args = [] if f.attr == "zero_" else copy.deepcopy(node.args)
            keywords = [] if f.attr == "zero_" else copy.deepcopy(node.keywords)
            out.append(("inplace", ast.Call(func, args, keywords)))
    return out


def _walk_function_bodies(tree: ast.Module) -> list[ast.AST]:
    nodes: list[ast.AST] = []

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for stmt in node.body:
                visit(stmt, True)  # not the defaults, decorators or annotations
            return
        if isinstance(node, ast.JoinedStr):
            return
        if isinstance(node, ast.AnnAssign):
            if node.value is not None:
                visit(node.value, inside)
            return
        if inside:
            nodes.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return nodes


def find_mutants(path: str) -> list[Mutant]:
    source = (ROOT / path).read_text()
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    skipped = _skipped_ranges(tree)
    out = []
    for node in _walk_function_bodies(tree):
        line = getattr(node, "lineno", None)
        if line is None or any(a <= line <= b for a, b in skipped):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            muts: list[tuple[str, str]] = [("stmt", "pass")]
        else:
            muts = [(op, ast.unparse(m)) for op, m in _mutations(node)]
        for op, text in muts:
            mutated = _splice(lines, node, text)
            if mutated is None or mutated == source:
                continue
            try:
                compile(mutated, path, "exec")
            except SyntaxError:
                continue
            before = lines[line - 1].strip()
            after_lines = mutated.splitlines()
            out.append(Mutant(path, line, op, before, after_lines[line - 1].strip()))
            out[-1].__dict__["_source"] = mutated
    return out


def _splice(lines: list[str], node: ast.AST, text: str) -> str | None:
    l0, c0 = node.lineno, node.col_offset  # type: ignore[attr-defined]
    l1, c1 = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    if l1 is None or c1 is None:
        return None
    # ast offsets are in UTF-8 bytes
    head: str = lines[l0 - 1].encode()[:c0].decode()
    tail: str = lines[l1 - 1].encode()[c1:].decode()
    return "".join(lines[: l0 - 1]) + head + text + tail + "".join(lines[l1:])


def _copy_repo(dest: Path) -> None:
    for name in ("dtlab", "tests", "scripts"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".*cache"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)


def _pytest(repo: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    cmd += [a for d in DESELECT if d.split("::")[0] in tests for a in ("--deselect", d)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=repo, env=env, timeout=timeout, capture_output=True, text=True, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0
    return ("survived" if proc.returncode == 0 else "killed"), time.perf_counter() - t0


def _survivors(results: list[Path]) -> dict[tuple[str, str, str, str], int]:
    """(path, operator, line before, line after) -> line, of every survivor in earlier results."""
    out = {}
    for f in results:
        text = f.read_text()
        rows = (
            json.loads(text)["mutants"] if f.suffix == ".json" else [json.loads(x) for x in text.splitlines()]
        )
        out.update(
            {
                (r["path"], r["op"], r["before"], r["after"]): r["line"]
                for r in rows
                if r["status"] == "survived"
            }
        )
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="*", help="files to mutate (default: every file in TESTS)")
    ap.add_argument("--per-file", type=int, default=6, help="mutants per file, a seeded sample (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (each in its own copy)")
    ap.add_argument("--timeout-factor", type=float, default=3.0, help="x the unmutated run's time, +20 s")
    ap.add_argument("--json", type=Path, help="write every mutant and its outcome here")
    ap.add_argument("--ids", nargs="*", help="run only these mutants (path:line:operator, e.g. survivors)")
    ap.add_argument(
        "--survivors-of",
        type=Path,
        nargs="*",
        help="run only the survivors of earlier --json results (found again by their text: lines move)",
    )
    ap.add_argument(
        "--since",
        metavar="REV",
        help="only sites on lines added or changed since the git revision REV (git diff -U0 REV)",
    )
    ap.add_argument("--list", action="store_true", help="list the sites and the test subsets, run nothing")
    ap.add_argument("--min-rate", type=float, default=0.9)
    ap.add_argument(
        "--report", type=Path, help="summarise an earlier --json (with ACCEPTED as it is now), run nothing"
    )
    return ap


def _report(args: argparse.Namespace) -> int:
    """Summarise an earlier --json (or the .partial.jsonl of a run that did not finish)."""
    data: dict[str, Any]
    if args.report.suffix == ".jsonl":  # the lines of a run that did not finish
        rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        data = {"wall_seconds": float("nan"), "mutants": rows}
    else:
        data = json.loads(args.report.read_text())
    done = [Mutant(**{k: v for k, v in row.items() if k != "id"}) for row in data["mutants"]]
    for m in done:
        if m.status == "survived" and m.text_key in ACCEPTED:
            m.status = "accepted"
    return _summary(done, sorted({m.path for m in done}), data["wall_seconds"], args)


def _changed_lines(rev: str, path: str) -> set[int]:
    """The lines of ``path`` (as it is now) added or changed since the git revision ``rev``."""
    diff = subprocess.run(
        ["git", "diff", "-U0", "--no-color", rev, "--", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out: set[int] = set()
    for line in diff.splitlines():
        if line.startswith("@@"):  # @@ -a,b +c,d @@: d lines from c (d omitted: 1; 0: only removed)
            new = line.split()[2][1:].split(",")
            start, count = int(new[0]), int(new[1]) if len(new) > 1 else 1
            out.update(range(start, start + count))
    return out


def _plan(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[list[str], list[Mutant]]:
    """The files to mutate and the mutants chosen in them, as the arguments ask."""
    files = args.files or list(TESTS)
    wanted = _survivors(args.survivors_of) if args.survivors_of else None
    if wanted is not None:
        files = [f for f in files if any(w[0] == f for w in wanted)]
    if args.ids:
        files = [f for f in files if any(i.startswith(f + ":") for i in args.ids)]
    unknown = [f for f in files if f not in TESTS]
    if unknown:
        ap.error(f"no test subset for {unknown}; add them to TESTS in {Path(__file__).name}")
    plan: list[Mutant] = []
    for f in files:
        found = find_mutants(f)
        rng = random.Random(f"{args.seed}:{f}")
        if args.since:
            changed = _changed_lines(args.since, f)
            found = [m for m in found if m.line in changed]
        chosen = found if args.per_file <= 0 else rng.sample(found, min(args.per_file, len(found)))
        if args.ids:
            chosen = [m for m in found if m.id in args.ids]
        if wanted is not None:  # the same text nearest the line it had
            chosen = []
            for key, line in wanted.items():
                same = [m for m in found if (m.path, m.op, m.before, m.after) == key]
                chosen += sorted(same, key=lambda m: abs(m.line - line))[:1]
        chosen.sort(key=lambda m: m.line)
        print(f"{f}: {len(found)} sites, {len(chosen)} mutants; tests: {' '.join(TESTS[f])}", flush=True)
        plan += chosen
    return files, plan


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.report:
        return _report(args)
    files, plan = _plan(args, ap)
    if args.list:
        for m in plan:
            print(f"  {m.id}: {m.before}  ->  {m.after}")
        return 0

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="dtlab-mutate-"))
    try:
        repos = []
        for j in range(max(1, args.jobs)):
            repo = work / f"w{j}"
            _copy_repo(repo)
            repos.append(repo)
        baseline: dict[str, float] = {}
        for subset in sorted({tuple(TESTS[f]) for f in files}):
            # each subset must pass on the unmutated code; its time sets the mutants' timeout
            status, secs = _pytest(repos[0], list(subset), 1800)
            if status != "survived":
                print(f"{' '.join(subset)} fail on the unmutated code: fix that first", file=sys.stderr)
                return 2
            for f in files:
                if tuple(TESTS[f]) == subset:
                    baseline[f] = secs
            print(f"baseline {secs:6.1f}s {' '.join(subset)}", flush=True)
        free = list(repos)
        lock = threading.Lock()

        def run(m: Mutant) -> Mutant:
            repo = free.pop()
            target = repo / m.path
            original = target.read_text()
            try:
                target.write_text(m.__dict__["_source"])
                limit = args.timeout_factor * baseline[m.path] + 20
                m.status, m.seconds = _pytest(repo, TESTS[m.path], limit)
            finally:
                target.write_text(original)
                free.append(repo)
            if m.status == "survived" and m.text_key in ACCEPTED:
                m.status = "accepted"
            print(f"{m.status:9s} {m.seconds:6.1f}s {m.id}: {m.after}", flush=True)
            if args.json:  # one line per mutant as it finishes: an interrupted run keeps its results
                with lock, open(args.json.with_suffix(".partial.jsonl"), "a") as f:
                    f.write(json.dumps(asdict(m)) + "\n")
            return m

        with ThreadPoolExecutor(max_workers=len(repos)) as pool:
            done = list(pool.map(run, plan))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - t_start
    if args.json:
        rows = [{k: v for k, v in asdict(m).items()} | {"id": m.id} for m in done]
        args.json.write_text(json.dumps({"wall_seconds": wall, "mutants": rows}, indent=1))
    return _summary(done, files, wall, args)


def _summary(done: list[Mutant], files: list[str], wall: float, args: argparse.Namespace) -> int:
    survived = [m for m in done if m.status == "survived"]
    accepted = [m for m in done if m.status == "accepted"]
    killed = [m for m in done if m.status in ("killed", "timeout")]
    rate = (len(killed) + len(accepted)) / max(1, len(done))
    print(f"\n{len(done)} mutants in {len(files)} files: {len(killed)} killed "
          f"({sum(m.status == 'timeout' for m in done)} by timeout), {len(accepted)} accepted as "
          f"equivalent, {len(survived)} survived; kill rate {rate:.1%} "
          f"({len(killed) / max(1, len(done)):.1%} without the accepted); wall {wall:.0f} s")  # fmt: skip
    for m in survived:
        print(f"SURVIVED {m.id}: {m.before}  ->  {m.after}")
    for m in accepted:
        print(f"accepted {m.id}: {ACCEPTED[m.text_key]}")
    packages: dict[str, list[int]] = {}
    for m in done:
        row = packages.setdefault(m.path.split("/")[1], [0, 0])
        row[0] += 1
        row[1] += m.status in ("killed", "timeout", "accepted")
    print(
        "per package (mutants, killed or accepted): "
        + ", ".join(f"{k} {v[1]}/{v[0]}" for k, v in packages.items())
    )
    return 0 if rate >= args.min_rate else 1


if __name__ == "__main__":
    sys.exit(main())
