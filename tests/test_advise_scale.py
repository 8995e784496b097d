"""``dtlab advise`` at scale: precision policies, tied embeddings, accumulation and interleaving in
the search, the step-time model's schedules and overlap, one given plan and the JSON pipe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, Precision, advise, candidates, predict, runnable
from dtlab.advise.layout import transformer_tensors
from dtlab.advise.plan import parse_plan
from dtlab.advise.timing import PassTimes, pipeline_seconds
from dtlab.cli import main
from dtlab.errors import ArgumentError
from dtlab.models.pipeline import Kind, build_schedule, simulate

SPEC = ModelSpec(layers=12, hidden=1024, heads=16, vocab=32000, seq_len=1024)


def _state(p: object) -> int:
    m = p.memory  # type: ignore[attr-defined]
    return int(m.parameters + m.gradients + m.optimizer_state)


def test_precision_puts_each_kind_at_its_width() -> None:
    cluster = ClusterSpec(ranks=8)
    n = SPEC.parameters
    bf16 = Precision.named("bf16-mixed")
    assert (bf16.params, bf16.compute, bf16.grads, bf16.master, bf16.states, bf16.activations) == (
        4,
        2,
        4,
        0,
        4,
        2,
    )
    ddp = predict(SPEC, cluster, Candidate("ddp", dp=8), 64, precision=bf16)
    assert _state(ddp) == pytest.approx(16 * n, rel=1e-4)  # fp32 parameters, gradients, two Adam states
    assert ddp.memory.transient == pytest.approx(2 * n, rel=1e-3)  # autocast's bf16 copies
    fp32 = predict(SPEC, cluster, Candidate("ddp", dp=8), 64)
    assert ddp.memory.activations < 0.51 * fp32.memory.activations
    megatron = bf16.custom("megatron", params=2, compute=2, master=4)
    z1 = predict(SPEC, cluster, Candidate("zero1", dp=8), 64, precision=megatron)
    assert _state(z1) == pytest.approx((2 + 4 + 12 / 8) * n, rel=1e-3)  # master and Adam sharded
    z2 = predict(SPEC, cluster, Candidate("zero2", dp=8), 64, precision=megatron)
    assert _state(z2) == pytest.approx((2 + 16 / 8) * n, rel=1e-3)  # gradients sharded too
    f = predict(SPEC, cluster, Candidate("fsdp", dp=8), 64, precision=megatron)
    assert _state(f) == pytest.approx(18 / 8 * n, rel=1e-3)  # everything sharded
    dp_bytes = predict(SPEC, cluster, Candidate("zero1", dp=8), 64, precision=megatron).axes["dp"]
    # fp32 gradients reduce-scattered, bf16 parameters gathered: 7/8 of 4 + 2 bytes per parameter
    assert dp_bytes.bytes_sent == pytest.approx(7 / 8 * 6 * n, rel=1e-3)
    with pytest.raises(ArgumentError, match="unknown precision 'bf16'"):
        Precision.named("bf16")
    with pytest.raises(ArgumentError, match=r"Precision\.grads"):
        bf16.custom(grads=0)
    assert runnable(Candidate("ddp", dp=8), SPEC, bf16)
    assert not runnable(Candidate("ddp", dp=8), SPEC, megatron)  # dtlab keeps fp32 parameters


def test_tied_embeddings_are_one_weight_or_a_copy_on_the_last_stage() -> None:
    tied = ModelSpec(4, 256, 8, 1000, 128, tied_embeddings=True)
    untied = ModelSpec(4, 256, 8, 1000, 128)
    assert untied.parameters - tied.parameters == 1000 * 256
    assert "head.weight" not in {t.name for t in transformer_tensors(tied)}
    assert "head.weight" in {t.name for t in transformer_tensors(tied, pipelined=True)}
    c = Candidate("ddp", pp=2, schedule="1f1b", micro_batches=2)
    p = predict(tied, ClusterSpec(ranks=2), c, 4)
    for r in (0, 1):  # first and last stage sum the embedding's gradient with one all-reduce (and the
        # loss with each rank's count of unused parameters with another: 1 + p float32, 12 bytes at p=2)
        assert p.stage_ops[r]["pp"]["all_reduce"] == (2, 1000 * 256 * 4 + 12)
    assert not runnable(c, tied) and runnable(c, untied)
    assert runnable(Candidate("ddp", dp=2), tied)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (3, 6)])
def test_step_time_is_the_schedule_with_unequal_passes(p: int, m: int) -> None:
    """F, I and W unequal (as the GEMM model makes them): the closed forms equal simulate()."""
    f, i, w = 1.0, 1.4, 0.8
    t = PassTimes(f, i, w)
    costs = {Kind.F: f, Kind.B: i + w, Kind.I: i, Kind.W: w}
    for name in ("gpipe", "1f1b", "zero_bubble"):
        s = build_schedule(name, p, m)
        want = m * (f + i + w) / (1 - simulate(s, costs).bubble())
        assert pipeline_seconds(name, p, m, 1, t) == pytest.approx(want), name
    if m % p == 0:
        s = build_schedule("interleaved_1f1b", p, m, 2)
        per_chunk = {k: c / 2 for k, c in costs.items()}
        want = m * (f + i + w) / (1 - simulate(s, per_chunk).bubble())
        assert pipeline_seconds("interleaved_1f1b", p, m, 2, t) == pytest.approx(want)


def test_the_steady_replay_finds_the_whole_replay_s_peak() -> None:
    from dtlab.advise.pipeline import activation_peak, split_stages

    spec = ModelSpec(24, 256, 8, 5000, 128)
    for p, v in [(2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (3, 2), (4, 3), (2, 4)]:
        stages = split_stages(spec, transformer_tensors(spec, pipelined=True), p * v)
        for m in (p * (v + 3) + p, 4 * p * (v + 4), 64):
            if m % p:
                continue
            sched = "interleaved_1f1b" if v > 1 else "zero_bubble"
            c = Candidate("ddp", pp=p, schedule=sched, micro_batches=m, stages_per_rank=v)
            for r in range(p):
                mine = [stages[k * p + r] for k in range(v)]
                fast = activation_peak(spec, c, r, mine, 2, 4)
                assert fast == activation_peak(spec, c, r, mine, 2, 4, shortcut=False), (p, v, m, r)


def test_search_accumulates_and_interleaves_by_every_factor() -> None:
    seen = list(candidates(8, 32, layers=12))
    assert any(c.pp == 1 and c.micro_batches == 4 for c in seen)  # accumulation without a pipeline
    chunks = {(c.pp, c.stages_per_rank) for c in seen if c.schedule == "interleaved_1f1b"}
    assert chunks == {(2, 2), (2, 3), (2, 6), (4, 3)}  # pp v dividing 12, v <= 8
    assert not any(c.checkpointing == "stage" and c.schedule == "zero_bubble" for c in seen)
    assert all(c.checkpointing != "stage" for c in seen if c.pp == 1)


def test_small_matrices_and_overlap_shape_the_step() -> None:
    cluster = ClusterSpec(ranks=8)
    small = ModelSpec(24, 2048, 16, 51200, 2048)
    dp = predict(small, cluster, Candidate("zero1", dp=8, micro_batches=4), 32)
    tp = predict(small, cluster, Candidate("zero1", tp=8, micro_batches=32), 32)
    assert tp.compute_seconds > dp.compute_seconds * 1.04  # 256-wide slices run below the rate
    assert tp.axes["tp"].exposed > 0 and dp.axes["dp"].exposed < dp.axes["dp"].seconds
    # ZeRO-3 gathers hide behind the compute of its micro-batches
    z3 = predict(small, cluster, Candidate("zero3", dp=8, micro_batches=4), 32)
    assert z3.axes["dp"].exposed < 0.2 * z3.axes["dp"].seconds
    best = advise(small, ClusterSpec(ranks=32), 512, precision=Precision.named("bf16-mixed")).plans[0]
    assert best.candidate.pp == 1 and best.candidate.tp == 1  # a 1.7B model: data parallel alone


def test_a_given_plan_is_placed_among_all(capsys: pytest.CaptureFixture[str]) -> None:
    c = parse_plan("dp=8,tp=4,pp=12,strategy=zero1,schedule=1f1b,micro_batch=2,checkpointing=full", 384, 2048)
    assert c == Candidate("zero1", 8, 4, 12, "1f1b", 128, 1, "block")
    assert parse_plan("strategy=fsdp,tp=2", 8, 32) == Candidate("fsdp", dp=4, tp=2)
    assert parse_plan("strategy=ddp,pp=2,v=2,micro_batches=4", 4, 8).schedule == "interleaved_1f1b"
    for bad, msg in [
        ("dp=3,strategy=ddp", "dp=3 x tp=1 x pp=1 = 3 ranks"),
        ("strategy=ddp,micro_batch=3", "micro_batch=3 does not divide"),
        ("strategy=ddp,color=red", "not KEY=VALUE"),
        ("dp=8", "needs strategy="),
    ]:
        with pytest.raises(ArgumentError, match=msg):
            parse_plan(bad, 8, 32)
    args = ["advise", "--layers", "8", "--hidden", "512", "--heads", "8", "--ranks", "8", "--top", "3"]
    assert main([*args, "--plan", "strategy=zero1,tp=2,micro_batch=2"]) == 0
    out = capsys.readouterr().out
    assert "(given)" in out and "zero1 dp4 tp2 accum4" in out
    assert main([*args, "--json", "--plan", "strategy=zero1,tp=2,micro_batch=2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["place"] >= 1 and doc["plan"]["micro_batch"] == 2 and len(doc["plans"]) == 3
    assert main([*args, "--plan", "strategy=ddp,tp=8,pp=1,micro_batches=3"]) == 2
    assert "micro_batches=3 does not divide" in capsys.readouterr().err
    assert main([*args, "--heads", "6", "--hidden", "516", "--plan", "strategy=ddp,tp=4"]) == 1
    assert "heads=6 not divisible by tp=4" in capsys.readouterr().err


def test_json_pipes_into_head_quietly() -> None:
    cmd = f"{sys.executable} -m dtlab advise --json --top 0 --ranks 16 | head -n 2"
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.startswith("{") and done.stderr == ""


def test_a_70b_model_on_1024_ranks_is_advised() -> None:
    # how long the search takes is a figure in docs/strategies.md, with its command, not asserted here
    spec = ModelSpec.from_parameters(70_000_000_000, layers=80, heads=64, vocab=51200, seq_len=2048)
    result = advise(spec, ClusterSpec(ranks=1024), 1024, precision=Precision.named("bf16-mixed"))
    assert result.considered == 4000 and result.plans


@pytest.mark.parametrize("tied", [False, True])
def test_a_layout_built_with_one_block_is_the_whole_models(tied: bool) -> None:
    from dtlab.backends.inmemory import InMemoryWorld
    from dtlab.core.rng import seeded_init
    from dtlab.models import apply_tensor_plan, transformer_plan
    from dtlab.zoo import Block, TransformerLM

    spec = ModelSpec(5, 64, 4, 96, 16, tied_embeddings=tied)
    for tp in (1, 2, 4):
        with seeded_init(0):  # every block built on the CPU and split as a run does (no meta shortcut)
            whole = TransformerLM(64, 5, 4, 16, vocab=96, tie_embeddings=tied)
        if tp > 1:
            apply_tensor_plan(whole, transformer_plan(), InMemoryWorld(tp).backend(0))
        layer = {id(m): i - 1 for i, (_, b) in enumerate(whole.pipeline_blocks()) for m in b.modules()}
        unit = {id(m): n for n, b in whole.named_modules() if isinstance(b, Block) for m in b.modules()}
        for pipelined in (False, True):
            real = []
            for name, param in whole.named_parameters(remove_duplicate=not pipelined):
                mod = whole.get_submodule(name.rpartition(".")[0])
                real.append(
                    (
                        name,
                        param.numel(),
                        name.rpartition(".")[0],
                        unit.get(id(mod), "<root>"),
                        layer[id(mod)],
                    )
                )
            laid = [
                (t.name, t.numel, t.module, t.unit, t.layer) for t in transformer_tensors(spec, tp, pipelined)
            ]
            assert laid == real, (tp, pipelined)
