"""Compression on the dp axis of a tensor-parallel mesh (dp 2 x tp 2, the tiny transformer): each
buffer's parameters every tp rank holds whole are compressed as a buffer of their own, so every
compressor treats their gradient alike on every tp rank and their copies stay bitwise equal (before,
the top-k compressors and QSGD selected or rounded them differently per tp rank and the model's
comparison of those gradients refused them at the first step)."""

from __future__ import annotations

from typing import Any

import torch
from hybrid_cases import OPTIMIZER_OF, hybrid_model
from test_tensor_helpers import batch, max_rel_error, train_reference

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import FP16, QSGD, GaussianK, GTopk, OkTopk, PowerSGD, RandomK, TopkA, TopkDSA
from dtlab.compression.base import Compressor
from dtlab.errors import StrategyError
from dtlab.optimizers import GradientCompressionOptimizer

SHAPE = {"dp": 2, "tp": 2}
STEPS = 3
#: (name, data-parallel strategy, sequence parallelism, compressor)
CASES: list[tuple[str, str, bool, Compressor]] = [
    ("topka", "ddp", False, TopkA(density=0.05)),
    ("topkdsa", "ddp", False, TopkDSA(density=0.05)),
    ("gtopk", "ddp", False, GTopk(density=0.05)),
    ("gaussiank", "ddp", False, GaussianK(density=0.05)),
    ("oktopk", "ddp", False, OkTopk(density=0.05, warmup_steps=0)),
    ("qsgd", "ddp", False, QSGD()),
    ("randomk", "ddp", False, RandomK(density=0.05)),
    ("powersgd", "ddp", False, PowerSGD(warmup_steps=0)),
    ("fp16", "ddp", False, FP16()),
    ("oktopk-zero2", "zero2", False, OkTopk(density=0.05, warmup_steps=0)),
    ("oktopk-sequence-parallel", "ddp", True, OkTopk(density=0.05, warmup_steps=0)),
    ("topka-density-1", "ddp", False, TopkA(density=1.0)),
]


def compressed_world(backend: CommunicationBackend) -> dict[str, Any]:
    """Every case on one rank: STEPS plain SGD steps, then the whole parameters held here, the losses,
    the full state and the last step's statistics (or the refusal)."""
    from test_tensor_helpers import OPTIMIZERS

    cls, kwargs, _ = OPTIMIZERS["sgd_plain"]
    out: dict[str, Any] = {}
    for name, data_parallel, sp, compressor in CASES:
        model = hybrid_model(backend, SHAPE, data_parallel, sequence_parallel=sp)
        inner = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
        opt = GradientCompressionOptimizer(inner, compressor, dense_below=0)  # the small part compressed too
        x, y = batch()
        coord = model.mesh.coordinate("dp")
        losses = []
        try:
            for _ in range(STEPS):
                loss = model.train_step((x.chunk(2)[coord], y.chunk(2)[coord]), model.cross_entropy)
                losses.append(float(loss))
                opt.step()
                opt.zero_grad()
        except StrategyError as exc:
            out[name] = {"refused": str(exc)}
            continue
        whole = model.same_grad_over_tp
        held = {n: p.detach().clone() for n, p in model.dp_strategy.trainable_parameters() if n in whole}
        state = model.full_state_dict() if name == "topka-density-1" else None
        sizes = []  # the compressed buffers' sizes: each unit's two parts, or the unit where it is not cut
        for unit in model.shard_units():
            ranges = opt.reducer.tp_parts.ranges.get(unit.key, [])
            whole_n = sum(n for _, n in ranges)
            sizes += [whole_n, unit.padded - whole_n] if ranges else [unit.padded]
        out[name] = {"whole": held, "losses": losses, "state": state, "stats": opt.statistics, "sizes": sizes}
    return out


def test_every_compressor_keeps_the_whole_parameters_equal_over_tp() -> None:
    from dtlab.testing import run_world

    results = run_world(4, compressed_world, timeout=300)
    _, ref_state = train_reference("sgd_plain", STEPS)
    for name, *_ in CASES:
        for dp in range(2):
            a, b = results[2 * dp][name], results[2 * dp + 1][name]  # tp innermost: ranks 2d, 2d + 1
            assert "refused" not in a and "refused" not in b, (name, a.get("refused"))
            assert a["whole"] and a["whole"].keys() == b["whole"].keys(), name
            for n, t in a["whole"].items():
                assert torch.equal(t, b["whole"][n]), (name, dp, n, (t - b["whole"][n]).abs().max())
            assert all(torch.isfinite(torch.tensor(a["losses"]))), (name, a["losses"])
        if name not in ("qsgd", "powersgd", "fp16", "topka-density-1"):
            density = results[0][name]["stats"].get("density")
            assert density is None or 0 < density < 0.5, (name, density)
    # TopkA's bytes stay exactly its formula per compressed buffer: a ring all-gather of k (index, value)
    # pairs over dp (P = 2) plus the non-finite check's P int32 all-reduced
    for rank, res in enumerate(results):
        topka = res["topka"]
        assert len(topka["sizes"]) >= 2, topka["sizes"]  # the bucket was cut in two
        expected = sum((2 - 1) * int(0.05 * n) * 8 + 2 * (2 - 1) * 4 for n in topka["sizes"])
        assert topka["stats"]["bytes_sent"] == expected, (rank, topka["stats"]["bytes_sent"], expected)
    # density 1: every element selected, so the run is the plain one (the single-process reference)
    for rank, res in enumerate(results):
        state = res["topka-density-1"]["state"]
        assert max_rel_error(state, ref_state) <= 1e-5, rank


def _resume_world(backend: CommunicationBackend, saved: list[Any] | None) -> dict[str, Any]:
    """Ok-Topk and QSGD at dp 2 x tp 2: 2 steps, this rank's checkpoint, 2 more steps (``saved`` None);
    or the checkpoint every rank wrote loaded into a fresh model and the same 2 steps."""
    from test_tensor_helpers import OPTIMIZERS

    cls, kwargs, _ = OPTIMIZERS["sgd_plain"]
    out: dict[str, Any] = {}
    for compressor in (OkTopk(density=0.05, warmup_steps=0), QSGD()):
        model = hybrid_model(backend, SHAPE, "ddp")
        inner = OPTIMIZER_OF["ddp"](model, cls, **kwargs)
        opt = GradientCompressionOptimizer(inner, compressor, dense_below=0)
        x, y = batch()
        coord = model.mesh.coordinate("dp")
        if saved is not None:
            model.load_sharded_state_dict([s[compressor.name][0] for s in saved])
            opt.load_sharded_state_dict([s[compressor.name][1] for s in saved])
        for step in range(2 if saved is not None else 4):
            if step == 2:
                out[compressor.name] = (model.sharded_state_dict(), opt.sharded_state_dict())
            model.train_step((x.chunk(2)[coord], y.chunk(2)[coord]), model.cross_entropy)
            opt.step()
            opt.zero_grad()
        out[compressor.name + " state"] = model.full_state_dict()
    return out


def test_a_resume_on_the_mesh_continues_exactly() -> None:
    """Each rank's compression state (both parts' residuals and state) is saved in its own shard of the
    mesh and restored from it (was: 'written by 4 ranks, this run has 2', started afresh)."""
    from dtlab.testing import run_world

    first = run_world(4, _resume_world, None, timeout=300)
    saved = [{k: v for k, v in res.items() if not k.endswith(" state")} for res in first]
    for res in saved:
        assert any(k.endswith(".tp_whole") for k in res["oktopk"][1].tensors), sorted(
            res["oktopk"][1].tensors
        )
    resumed = run_world(4, _resume_world, saved, timeout=300)
    for rank, (a, b) in enumerate(zip(first, resumed, strict=True)):
        for name in ("oktopk", "qsgd"):
            x, y = a[name + " state"], b[name + " state"]
            assert all(torch.equal(x[k], y[k]) for k in x), (rank, name)


def _cut_world(backend: CommunicationBackend) -> dict[str, list[str]]:
    """State of an 8-element buffer 'b' reduced whole and reduced cut (its first 4 elements whole over
    tp), each loaded into a reducer that cuts it and one that does not: the buffers it keeps."""
    from dtlab.compression import CompressedReducer

    def reducer(cut: bool) -> CompressedReducer:
        return CompressedReducer(
            backend, TopkA(density=0.5), dense_below=0, tp_whole={"b": [(0, 4)]} if cut else None
        )

    saved = {}
    for cut in (False, True):
        red = reducer(cut)
        red.all_reduce("b", torch.arange(8, dtype=torch.float32)).wait()
        saved[cut] = red.state_dict()
    out = {}
    for written in (False, True):
        for cut in (False, True):
            red = reducer(cut)
            red.load_state_dict(*saved[written])
            out[f"{written}->{cut}"] = sorted(red.state_dict()[1]["buffers"])
    return out


def test_state_of_another_cut_starts_afresh_with_a_warning(caplog: Any) -> None:
    """A checkpoint whose buffer was compressed whole (before the cut, or on another mesh) loaded where
    it is cut, or the reverse: its state is dropped with a warning (was: kept silently, never used, the
    reduced buffers started afresh unannounced); the same cut restores its parts."""
    from dtlab.testing import run_world

    (out,) = run_world(1, _cut_world, timeout=60)
    assert out == {
        "False->False": ["b"],
        "False->True": [],
        "True->False": [],
        "True->True": ["b.tp_own", "b.tp_whole"],
    }, out
    warned = [r.getMessage() for r in caplog.records if "another tensor-parallel cut" in r.getMessage()]
    assert len(warned) == 2 and "['b']" in warned[0] and "['b.tp_own', 'b.tp_whole']" in warned[1], warned


def _small_part_world(backend: CommunicationBackend) -> torch.Tensor:
    """TopkA at density 0.01 on a 1000-element buffer whose first 10 elements are whole over tp."""
    from dtlab.compression import CompressedReducer

    red = CompressedReducer(backend, TopkA(density=0.01), dense_below=0, tp_whole={"b": [(0, 10)]})
    grad = torch.arange(1000, dtype=torch.float32) * (backend.rank + 1)
    red.all_reduce("b", grad).wait()
    return grad


def test_a_part_too_small_for_one_element_goes_dense() -> None:
    """The whole part of a bucket that the density compresses (1000 x 0.01: k = 10) can be too small
    for one element (10 x 0.01 rounds to 0): it goes dense (was: ConfigError naming 'b.tp_whole' and
    dense_below, which dtlab train does not set); the rest keeps its k."""
    from dtlab.testing import run_world

    for out in run_world(2, _small_part_world, timeout=60):
        assert torch.equal(out[:10], torch.arange(10, dtype=torch.float32) * 1.5), out[:10]
        assert int((out[10:] != 0).sum()) == 9, out[10:]  # int(0.01 * 990) of the own part


class _Branchy(torch.nn.Module):
    """``a`` and ``aux`` column-parallel, ``b`` row-parallel; ``b`` starts with the hidden units of tp
    rank 1 cut off, so only tp rank 0's ``aux`` shard gets a gradient (and a residual) in step 0."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.aux, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            self.b.weight[:, 8:] = 0
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.aux(x) if self.use_aux else self.a(x)
        return self.b(torch.tanh(h))


def _skipped_world(backend: CommunicationBackend) -> str:
    """``aux`` used in step 0, by no rank in step 1 (find_unused_parameters=True, TopkA at 10%): the
    refusal's text on this rank, or what else happened."""
    from dtlab.backends import Mesh
    from dtlab.models import HybridShardedModel
    from dtlab.optimizers import DDPOptimizer

    mesh = Mesh(backend, SHAPE)
    net = _Branchy()
    plan = {"a": "colwise", "aux": "colwise", "b": "rowwise"}
    model = HybridShardedModel(net, mesh, data_parallel="ddp", find_unused_parameters=True, tensor_plan=plan)
    opt = GradientCompressionOptimizer(
        DDPOptimizer(model, torch.optim.SGD, lr=0.1), TopkA(density=0.1, warmup_steps=0), dense_below=0
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    d = mesh.coordinate("dp")
    try:
        for step in range(3):
            net.use_aux = step == 0
            opt.zero_grad()
            model.train_step((x.chunk(2)[d], y.chunk(2)[d]), torch.nn.functional.cross_entropy)
            opt.step()
    except StrategyError as exc:
        return f"step {step}: {exc}"
    return "no refusal"


def test_a_skipped_parameter_owed_on_one_tp_rank_is_refused_on_every_rank() -> None:
    """At tp > 1 the residuals live in the cut buffer's parts and differ per tp rank: the refusal reads
    each parameter in its part and is agreed over tp too, so every rank of the mesh refuses step 1 (not
    the step silently dropping the owed update, nor tp rank 0 alone refusing while its tp peer goes on)."""
    from dtlab.testing import run_world

    out = run_world(4, _skipped_world, timeout=60)
    for rank, text in enumerate(out):
        assert text.startswith("step 1: ") and "no rank used" in text and "set_to_none=False" in text, (
            rank,
            text,
        )
    assert any("aux.weight" in text for text in out), out
