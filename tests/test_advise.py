"""The cost model of ``dtlab advise`` on its own: the model's layout against the real module, the
pipeline formulas against dtlab's schedules, placement, the search and the command line."""

from __future__ import annotations

import json
import re

import pytest

from dtlab.advise import (
    Candidate,
    ClusterSpec,
    ModelSpec,
    advise,
    candidates,
    predict,
    runnable,
)
from dtlab.advise.layout import transformer_tensors
from dtlab.advise.predict import Memo
from dtlab.advise.timing import bubble, comm_seconds, inside_node
from dtlab.cli import main
from dtlab.errors import ArgumentError
from dtlab.models.pipeline import Kind, build_schedule, simulate
from dtlab.trainers.models import TransformerLM


@pytest.mark.parametrize(("d", "layers", "heads", "seq"), [(32, 1, 2, 16), (48, 3, 4, 8), (128, 2, 4, 64)])
def test_layout_is_the_transformer_lm(d: int, layers: int, heads: int, seq: int) -> None:
    spec = ModelSpec.builtin(d_model=d, n_layers=layers, n_heads=heads, seq_len=seq)
    real = [(n, p.numel()) for n, p in TransformerLM(d, layers, heads, seq).named_parameters()]
    assert [(t.name, t.numel) for t in transformer_tensors(spec)] == real
    assert spec.parameters == sum(n for _, n in real)


def test_from_parameters_picks_the_nearest_width() -> None:
    spec = ModelSpec.from_parameters(1_300_000_000, layers=24, heads=16, vocab=50304, seq_len=2048)
    assert spec.hidden % 16 == 0
    assert spec.parameters == pytest.approx(1.3e9, rel=0.02)
    wider = ModelSpec(24, spec.hidden + 16, 16, 50304, 2048)
    narrower = ModelSpec(24, spec.hidden - 16, 16, 50304, 2048)
    assert abs(spec.parameters - 1.3e9) <= min(
        abs(wider.parameters - 1.3e9), abs(narrower.parameters - 1.3e9)
    )


def test_bad_specs_name_the_field() -> None:
    with pytest.raises(ArgumentError, match="hidden=30 is not divisible by heads=4"):
        ModelSpec(2, 30, 4)
    with pytest.raises(ArgumentError, match=r"ClusterSpec\.ranks"):
        ClusterSpec(ranks=0)
    with pytest.raises(ArgumentError, match=r"ClusterSpec\.latency_us"):
        ClusterSpec(ranks=2, latency_us=-1)
    with pytest.raises(ArgumentError, match=r"Candidate\.strategy"):
        Candidate("zero4")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="needs a schedule"):
        Candidate("ddp", pp=2)
    with pytest.raises(ArgumentError, match="unknown built-in model"):
        ModelSpec.builtin("gpt2")


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (3, 6)])
def test_pipeline_formulas_are_dtlab_schedules(p: int, m: int) -> None:
    unit = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
    for name in ("gpipe", "1f1b", "zero_bubble"):
        s = build_schedule(name, p, m)
        assert bubble(name, p, m) == pytest.approx(simulate(s, unit).bubble())
    if m % p == 0:
        for v in (2, 3):
            s = build_schedule("interleaved_1f1b", p, m, v)
            per_chunk = {k: c / v for k, c in unit.items()}
            assert bubble("interleaved_1f1b", p, m, v) == pytest.approx(simulate(s, per_chunk).bubble())


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 6), (4, 4), (4, 8), (3, 6)])
def test_compute_orders_are_dtlab_schedules(p: int, m: int) -> None:
    from dtlab.advise.pipeline import _order

    plans = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)] + (
        [("interleaved_1f1b", 2)] if m % p == 0 else []
    )
    for name, v in plans:
        s = build_schedule(name, p, m, v)
        c = Candidate("ddp", pp=p, schedule=name, micro_batches=m, stages_per_rank=v)
        for r in range(p):
            want = [(a.kind.value, a.stage // p, a.micro) for a in s.compute(r)]
            assert _order(c, r) == want, (name, r)


def test_alpha_beta_and_placement() -> None:
    cluster = ClusterSpec(ranks=16, bandwidth_gbps=800, latency_us=2, inter_node_bandwidth_gbps=100,
                          inter_node_latency_us=20, ranks_per_node=8)  # fmt: skip
    ops = {"all_reduce": (3, 10**9), "all_gather": (2, 10**8)}
    intra = comm_seconds(ops, 4, True, cluster)
    assert intra == pytest.approx(3 * 6 * 2e-6 + 2 * 3 * 2e-6 + 1.1e9 / 100e9)
    assert comm_seconds(ops, 4, False, cluster) == pytest.approx(
        3 * 6 * 20e-6 + 2 * 3 * 20e-6 + 1.1e9 / 12.5e9
    )
    assert comm_seconds(ops, 1, True, cluster) == 0.0
    assert [inside_node(n, cluster) for n in (1, 2, 4, 8, 16, 3)] == [True] * 4 + [False, False]
    spec = ModelSpec.builtin()
    p = predict(spec, cluster, Candidate("ddp", dp=4, tp=4), 32)
    assert p.axes["tp"].inside_node and not p.axes["dp"].inside_node  # dp groups span 16 ranks


def test_candidates_cover_every_mesh_once() -> None:
    seen = list(candidates(8, 16))
    assert len(seen) == len(set(seen))
    assert all(c.ranks == 8 for c in seen)
    meshes = {(c.dp, c.tp, c.pp) for c in seen}
    assert meshes == {
        (dp, tp, 8 // (dp * tp)) for dp in (1, 2, 4, 8) for tp in (1, 2, 4, 8) if 8 % (dp * tp) == 0
    }
    for c in seen:
        if c.pp > 1:
            assert c.micro_batches >= c.pp and (16 // c.dp) % c.micro_batches == 0
    assert any(c.schedule == "interleaved_1f1b" and c.stages_per_rank == 2 for c in seen)


def test_advise_ranks_the_plans_that_fit() -> None:
    spec = ModelSpec(layers=8, hidden=1024, heads=16, vocab=32000, seq_len=1024)
    cluster = ClusterSpec(ranks=8, memory_gib=6)
    result = advise(spec, cluster, 32)
    assert result.plans and result.considered > len(result.plans)
    times = [p.step_seconds for p in result.plans]
    assert times == sorted(times)
    assert all(p.fits and p.memory.total <= 6 * 2**30 for p in result.plans)
    # one memo for the whole sweep, as advise() shares one (the model built once, not per plan; that
    # a shared memo changes no prediction: test_a_shared_memo_changes_no_prediction)
    memo = Memo()
    everything = [predict(spec, cluster, c, 32, memo=memo) for c in candidates(8, 32)]
    too_big = [p for p in everything if not p.fits and not any("divisible" in q for q in p.problems)]
    assert too_big and all(any("GiB" in q for q in p.problems) for p in too_big)
    only = advise(spec, cluster, 32, runnable_only=True)
    assert all(p.runnable for p in only.plans)
    assert all(p.candidate.pp == 1 for p in only.plans if p.candidate.checkpointing == "block")
    assert all(p.candidate.pp > 1 for p in only.plans if p.candidate.checkpointing == "stage")


def test_divisibility_rules_leave_plans_out() -> None:
    spec = ModelSpec(layers=3, hidden=96, heads=3, vocab=251, seq_len=32)
    plans = advise(spec, ClusterSpec(ranks=4), 8).plans
    assert plans and all(p.candidate.tp == 1 for p in plans)  # 3 heads, vocabulary 251: no tp of 2 or 4
    assert all(p.candidate.pp in (1, 2) for p in plans)  # 3 layers: not 4 stages
    # 3 layers over 2 stages: uneven stages (balanced by parameters), which dtlab train does not cut
    assert any(p.candidate.pp == 2 for p in plans)
    assert not any(p.runnable for p in plans if p.candidate.pp == 2)
    bad = predict(
        spec, ClusterSpec(ranks=4), Candidate("ddp", dp=1, tp=2, pp=4, schedule="1f1b", micro_batches=1), 8
    )
    assert not bad.fits and len(bad.problems) == 4


def test_what_dtlab_runs_today() -> None:
    assert all(runnable(Candidate(s, dp=4)) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp"))  # type: ignore[arg-type]
    assert runnable(Candidate("fsdp", dp=4, checkpointing=True))  # per block, data parallel alone
    assert runnable(Candidate("ddp", dp=2, tp=2, checkpointing=True))  # per block under tp
    # dtlab checkpoints whole stages under a pipeline, not the blocks this model plans
    assert not runnable(Candidate("fsdp", dp=2, pp=2, schedule="1f1b", micro_batches=2, checkpointing=True))
    assert all(
        runnable(Candidate(s, dp=2, tp=2, pp=2, schedule="1f1b", micro_batches=2))
        for s in ("ddp", "zero2", "fsdp")
    )  # type: ignore[arg-type]


def test_checkpointing_trades_memory_for_compute() -> None:
    spec = ModelSpec(layers=12, hidden=768, heads=12, vocab=50304, seq_len=1024)
    cluster = ClusterSpec(ranks=4)
    plain = predict(spec, cluster, Candidate("ddp", dp=4), 32)
    ckpt = predict(spec, cluster, Candidate("ddp", dp=4, checkpointing=True), 32)
    assert ckpt.memory.activations + ckpt.memory.recompute < plain.memory.activations / 2
    assert ckpt.compute_seconds == pytest.approx(plain.compute_seconds)  # products, once each
    # the recomputed forward lengthens the step by about a third (F + B = 3 F, plus F)
    assert 1.25 < ckpt.step_seconds / plain.step_seconds < 4 / 3 + 1e-9


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--top", "3", "--ranks", "4", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "dtlab advise" in out and "\x1b[" not in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ", "4 ")]
    assert len(rows) == 3
    assert main(["advise", "--json", "--top", "2", "--layers", "4", "--hidden", "256", "--ranks", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["layers"] == 4 and doc["model"]["hidden"] == 256 and len(doc["plans"]) == 2
    first = doc["plans"][0]
    assert first["step_seconds"] <= doc["plans"][1]["step_seconds"]
    assert {"dp", "tp", "pp"} <= set(first["axes"]) and first["memory"]["total"] > 0


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--params", "1e9", "--hidden", "512"]) == 2
    assert "give --params or --hidden, not both" in capsys.readouterr().err
    assert main(["advise", "--ranks", "0"]) == 2
    assert "ClusterSpec.ranks must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["advise", "--memory-gb", "0.000001"]) == 1
    said = capsys.readouterr().err
    assert "none of the 660 plans fits: more than 1e-06 GiB per device (600 of them)" in said, said
    # the embedded model on 3 ranks: no plan fits for the sizes, not for memory; both say why
    assert main(["advise", "--ranks", "3"]) == 1
    said = capsys.readouterr().err
    assert "heads=4 not divisible by tp=3 (60 of them)" in said and "--global-batch 32" in said, said


def test_cli_tp_batch_check(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tp-batch-check`` is StrategyOptions.tp_batch_check: "always" counts one all-reduce of 6
    int64 per step over tp, "first" and "never" none; anything else is refused by name."""
    flags = ["advise", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--ranks", "2"]
    flags += ["--global-batch", "4", "--plan", "strategy=ddp,tp=2", "--top", "1", "--json"]
    tp = {}
    for when in ("always", "first", "never", None):
        assert main([*flags, *(["--tp-batch-check", when] if when else [])]) == 0
        count, sent = json.loads(capsys.readouterr().out)["plan"]["axes"]["tp"]["ops"]["all_reduce"]
        tp[when] = (count, sent)
    assert tp[None] == tp["always"] == (tp["never"][0] + 1, tp["never"][1] + 48)
    assert tp["first"] == tp["never"]
    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--tp-batch-check", "sometimes"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    # argparse's wording (quotes around the choices differ between Python versions)
    assert re.search(r"--tp-batch-check: invalid choice: '?sometimes'? \(choose from '?always'?, '?first'?, "
                     r"'?never'?\)", err), err  # fmt: skip
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["advise", "--help"])
    assert "--tp-batch-check {always,first,never}" in capsys.readouterr().out


def test_cli_find_unused_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """``--find-unused-parameters`` is StrategyOptions.find_unused_parameters (dtlab train's
    strategy.find_unused_parameters): per step one more all-reduce over dp of a float64 per trainable
    parameter the rank holds (29 for 2 blocks: 2 embeddings, 12 per block, the final norm's 2, the head),
    plus two float64 under ZeRO-3/FSDP; under a pipeline, one float32 over dp (whether every replica's
    loss had no graph) in place of the all-reduce of every replica's unused counts (dp x pp float32).
    Each rank's dp all-reduces, (calls, bytes), per pipeline rank."""
    flags = ["advise", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--ranks", "4"]
    flags += ["--global-batch", "8", "--top", "1", "--json"]

    def dp_all_reduce(plan: str, *more: str) -> list[tuple[int, int]]:
        assert main([*flags, "--plan", plan, *more]) == 0
        stages = json.loads(capsys.readouterr().out)["plan"]["stage_ops"]
        return [tuple(s["dp"].get("all_reduce", (0, 0))) for s in stages]

    for plan, extra in (("strategy=ddp,dp=4", 0), ("strategy=fsdp,dp=4", 24)):
        ((calls, sent),) = dp_all_reduce(plan)
        marks = 2 * 3 * 8 * 29 // 4  # an all-reduce of n bytes over 4 ranks counts 2 (4 - 1) n / 4
        assert dp_all_reduce(plan, "--find-unused-parameters") == [
            (calls + 1 + bool(extra), sent + marks + extra)
        ]
    before = dp_all_reduce("strategy=ddp,pp=2,dp=2")
    after = dp_all_reduce("strategy=ddp,pp=2,dp=2", "--find-unused-parameters")
    # stage 0: the embeddings and a block (14 tensors), stage 1: a block, the norm and the head (15);
    # one all-reduce more (the marks); the counts over dp (2 x 2 float32: 16 bytes at dp = 2) replaced
    # by one float32 (4 bytes)
    assert after == [
        (before[0][0] + 1, before[0][1] + 8 * 14 - 16 + 4),
        (before[1][0] + 1, before[1][1] + 8 * 15 - 16 + 4),
    ]
    table = [f for f in flags if f != "--json"]
    assert main([*table, "--plan", "strategy=ddp,dp=4", "--find-unused-parameters"]) == 0
    assert "--set strategy.find_unused_parameters=true" in capsys.readouterr().out  # the train command


def test_a_shared_memo_changes_no_prediction() -> None:
    spec = ModelSpec(layers=4, hidden=256, heads=8, vocab=1024, seq_len=128)
    cluster = ClusterSpec(ranks=8)
    memo = Memo()
    for c in candidates(8, 16):
        assert predict(spec, cluster, c, 16, memo=memo) == predict(spec, cluster, c, 16)


def test_the_fastest_runnable_plan_is_printed_as_a_dtlab_train_command_that_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dtlab.config import check_world_size, load_config
    from dtlab.trainers import run_training

    def command(*args: str) -> tuple[str, list[str]]:
        assert main(["advise", "--top", "5", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(("plan ", "the given plan ")))
        assert lines[at + 1].startswith("  dtlab train --set "), lines[at:]
        return lines[at], lines[at + 1].split("--set ")[1:]

    head, sets = command("--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16", "--ranks", "4",
                         "--global-batch", "8", "--precision", "bf16-mixed")  # fmt: skip
    sets = [s.strip() for s in sets]
    assert "model through model.factory" not in head
    assert {"backend.world_size=4", "model.n_layers=4", "model.d_model=32", "model.seq_len=16"} <= set(sets)
    assert {"data.global_batch_size=8", "train.precision=bf16"} <= set(sets), sets
    config = load_config(overrides=sets)  # every setting exists and passes the config's checks
    check_world_size(config, 4)
    tiny = ["train.steps=1", "train.eval_every=0", "data.max_bytes=20000", "logging.run_dir=null"]
    results = run_training(load_config(overrides=[*sets, *tiny, "logging.progress=false"]))
    assert len(results) == 4 and results[0].final_step == 1
    head, sets = command(
        "--ranks", "8", "--plan", "dp=2,tp=2,pp=2,strategy=fsdp,schedule=1f1b,micro_batches=4"
    )
    assert head.startswith("the given plan (fsdp dp2 tp2 pp2 1f1b m4) with dtlab train"), head
    assert [s.strip() for s in sets][1:] == [
        "strategy.model=fsdp", "parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b",
        "parallel.micro_batches=4",
    ]  # fmt: skip
    head, sets = command("--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "1000", "--ranks", "8")
    assert "(your model through model.factory)" in head  # not the built-in byte-level model
    assert not any(s.startswith("model.") for s in sets), sets
    check_world_size(load_config(overrides=[s.strip() for s in sets]), 8)
