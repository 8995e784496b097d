"""Every rank of a tensor-parallel group must be given the same batch. Data sharded by the global rank
(torch DDP's habit) gave each tp rank its own batch and trained on: the replicated parameters drifted
apart between tp ranks (full_state_dict summed to 14.407 on rank 0, 14.265 on rank 1 after one SGD
step at tp=2), no error. Now forward, the loss and train_step refuse inputs that differ over the tp
group (values, order, shape, dtype, names) with one StrategyError on every rank of the group, naming
the ranks and the fix; the same batch on every tp rank still trains as one process does.

How often is the model's tp_batch_check (TpBatchCheck): "always" (default), "first" (the first N calls
of each of forward, the loss, train_step) or "never" (no collective); counted here as the tp group's
all-reduces per step, the config's choice reaching the model through the run plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hybrid_cases import hybrid_model
from test_tensor_habits import LR, PLAN, build, data
from test_tensor_helpers import batch

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.config import from_dict
from dtlab.errors import ArgumentError, ConfigError, RankFailedError, StrategyError
from dtlab.models import HybridShardedModel, TensorParallelModel, TpBatchCheck
from dtlab.models.tensor._agree import check_same_on_tp
from dtlab.optimizers import DDPOptimizer
from dtlab.parallel_config import run_plan
from dtlab.testing import run_world

FIX = 'num_replicas=mesh.size("dp"), rank=mesh.coordinate("dp")'


def refusal(fn: Callable[[], object]) -> str:
    try:
        fn()
    except StrategyError as e:
        return str(e)
    return "accepted"


def one_process_step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    F.cross_entropy(net(x), y).backward()
    opt.step()
    return net.state_dict()


def policy_world(backend: CommunicationBackend, mesh: Mesh) -> dict[str, Any]:
    """The tp group's collectives per step under each tp_batch_check; batches sharded by the global
    rank (``mine``: differs between the tp ranks) where no check is due."""
    x, y = data(0)
    r, group = backend.rank, mesh["tp"]
    same, mine = (x[:4], y[:4]), (x.chunk(2)[r], y.chunk(2)[r])

    def steps(
        model: HybridShardedModel, *batches: tuple[torch.Tensor, torch.Tensor], fused: bool = False
    ) -> list[Any]:
        opt, counts = DDPOptimizer(model, torch.optim.SGD, lr=LR), []
        for bx, by in batches:
            before = group.stats.calls
            opt.zero_grad()
            try:
                if fused:
                    model.train_step((bx, by), model.cross_entropy)  # backward inside
                else:
                    model.cross_entropy(model(bx), by).backward()
            except StrategyError as e:
                counts.append(str(e))
                continue
            opt.step()
            counts.append(group.stats.calls - before)
        return counts

    def tp(choice: TpBatchCheck | str) -> TensorParallelModel:
        return TensorParallelModel(build(), mesh, plan=PLAN, tp_batch_check=choice)  # type: ignore[arg-type]

    config = from_dict({"parallel": {"tp": 2, "tp_batch_check": "never"}})
    plan = replace(run_plan(config, backend.world_size), tensor_plan=PLAN)
    before = backend.stats.calls
    try:
        tp("sometimes")
        bad = "accepted"
    except ArgumentError as e:
        bad = str(e)
    return {
        "bad": (bad, backend.stats.calls - before),
        "mixed": refusal(lambda: tp("never" if mesh.coordinate("tp") else "always")),
        "always": steps(tp("always"), same, same),
        "never": steps(tp("never"), mine, mine),
        "first": steps(tp("first"), same, same, same, mine),
        "first, differing": steps(tp("first"), mine, same),
        "always, fused": steps(tp("always"), same, same, fused=True),
        "never, fused": steps(tp("never"), mine, mine, fused=True),
        "first 2, fused": steps(tp(TpBatchCheck("first", first=2)), same, same, same, mine, fused=True),
        "config": (plan.tp_batch_check, steps(HybridShardedModel.from_plan(build(), mesh, plan), mine, mine)),
    }


def tp_world(backend: CommunicationBackend, shape: dict[str, int]) -> dict[str, Any]:
    mesh = Mesh(backend, shape)
    model = TensorParallelModel(build(), mesh, plan=PLAN)
    x, y = data(0)
    r, tp, dp, c = backend.rank, mesh.coordinate("tp"), mesh.size("dp"), mesh.coordinate("dp")
    out: dict[str, Any] = {"by_global_rank": refusal(lambda: model(x.chunk(backend.world_size)[r]))}
    if shape == {"tp": 2}:
        out |= {
            "rows_swapped": refusal(lambda: model(x.flip(0) if tp else x)),
            "one_ulp": refusal(lambda: model(torch.where(x == x[2, 3], x.nextafter(x + 1), x) if tp else x)),
            "shape": refusal(lambda: model(x[: 4 + tp])),
            "dtype": refusal(lambda: model(x.double() if tp else x)),
            "keyword": refusal(lambda: model(x) if tp else model(x=x)),
            "loss_targets": refusal(lambda: model.cross_entropy(model(x), y.roll(tp))),
            "step_targets": refusal(lambda: model.train_step((x, y.roll(tp)), F.cross_entropy)),
            "same_view": refusal(
                lambda: model(x.t().contiguous().t() if tp else x)
            ),  # same bits, other strides
            "policies": policy_world(backend, mesh),
        }
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    xs, ys = x.chunk(dp)[c], y.chunk(dp)[c]  # the fix: sharded by the dp coordinate
    model.cross_entropy(model(xs), ys).backward()
    opt.step()
    out["state"] = model.full_state_dict()
    return out


def test_tp_ranks_given_other_batches_are_refused_on_every_rank() -> None:
    reference = one_process_step(*data(0))
    for shape in ({"tp": 2}, {"dp": 2, "tp": 2}):
        results = run_world(2 * shape.get("dp", 1), tp_world, shape, timeout=60)
        for rank, got in enumerate(results):
            message = got.pop("by_global_rank")
            assert "given different inputs" in message and FIX in message, (shape, rank, message)
            first = rank - rank % 2  # the group's tp rank 0
            assert f"tp rank 1 (world rank {first + 1}): args[0] has other values" in message
            assert f"tp rank 0 is world rank {first}" in message
            for k, v in got.pop("state").items():  # the fix: the same batch on every tp rank
                torch.testing.assert_close(v, reference[k], rtol=1e-5, atol=1e-6, msg=f"{shape} {k}")
        if shape == {"tp": 2}:
            assert results[0] == results[1]  # every check on both ranks, the same message
            got = results[0]
            assert got["same_view"] == "accepted"
            assert "args[0] has other values (same shape (8, 8), torch.float32)" in got["rows_swapped"]
            assert "args[0] has other values" in got["one_ulp"]
            assert (
                "args[0] is shape (5, 8), torch.float32, on tp rank 0 shape (4, 8), torch.float32"
                in got["shape"]
            )
            assert (
                "args[0] is shape (8, 8), torch.float64, on tp rank 0 shape (8, 8), torch.float32"
                in got["dtype"]
            )
            assert "its inputs are ['args[0]'], tp rank 0's ['x']" in got["keyword"]
            assert (
                "different targets; tp rank 1 (world rank 1): targets has other values" in got["loss_targets"]
            )
            assert (
                "different batches; tp rank 1 (world rank 1): targets has other values" in got["step_targets"]
            )
            check_policies(got["policies"])


def check_policies(got: dict[str, Any]) -> None:
    """Collectives over tp per step: the model's own (n: forward and loss, f: train_step) plus one
    all-reduce per check (and one at the first synchronized backward, comparing the replicated
    parameters' gradients); "never" trains on batches that differ after the first step, "first"
    checks the first batch(es) only."""
    bad, calls = got["bad"]
    assert "TensorParallelModel(tp_batch_check='sometimes'): give one of 'always', 'first', 'never'" in bad
    assert calls == 0  # refused before any communication
    assert "built with different tp_batch_check policies" in got["mixed"]
    assert "tp rank 1 (world rank 1): TpBatchCheck(when='never', first=1)" in got["mixed"]
    n, f = got["first"][1], got["first 2, fused"][2]  # the model's own collectives per step
    # + 1 at the first synchronized backward: the replicated parameters' gradients compared over tp,
    # which refuses batches that differ between the tp ranks there when nothing compared them before
    never = [got["never"], got["never, fused"], got["config"][1]]
    for (refused, after), own in zip(never, [n, f, n], strict=True):
        assert "differ between the ranks of the tensor-parallel group" in refused, refused
        assert "given different batches (tp_batch_check='never' did not compare them)" in refused
        assert after == own  # compared once: later batches that differ train on unchecked
    assert got["always"] == [n + 3, n + 2]  # the inputs' check and the targets'
    assert got["first"] == [n + 3, n, n, n]  # the last batch differs: no longer checked
    refused, after = got["first, differing"]
    assert "given different inputs" in refused and FIX in refused
    assert after == n + 2  # the forward is no longer checked; the loss's first targets are, and the grads
    assert got["always, fused"] == [f + 2, f + 1]  # one check of the whole batch
    assert got["first 2, fused"] == [f + 2, f + 1, f, f]
    assert got["config"][0] == TpBatchCheck("never")


def test_tp_batch_check_policies_are_checked_before_use() -> None:
    assert TpBatchCheck() == TpBatchCheck("always", 1)
    for kwargs, says in [
        ({"when": "sometimes"}, "TpBatchCheck(when='sometimes'): choose one of 'always', 'first', 'never'"),
        ({"when": "first", "first": 0}, "TpBatchCheck.first must be an integer >= 1, got 0"),
        ({"when": "never", "first": 3}, "first counts the calls checked with when='first'"),
    ]:
        with pytest.raises(ArgumentError, match=says.replace("(", r"\(").replace(")", r"\)")):
            TpBatchCheck(**kwargs)
    config = from_dict({"parallel": {"tp": 2, "tp_batch_check": "first", "tp_batch_check_first": 3}})
    assert run_plan(config).tp_batch_check == TpBatchCheck("first", first=3)
    assert run_plan(from_dict({})).tp_batch_check == TpBatchCheck()
    for parallel, says in [
        ({"tp_batch_check": "sometimes"}, "parallel.tp_batch_check='sometimes' is not allowed: Input should "
         "be 'always', 'first' or 'never'"),
        ({"tp_batch_check_first": 2}, "parallel.tp_batch_check_first=2 counts the batches checked with "
         "parallel.tp_batch_check=first, got parallel.tp_batch_check=always"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            from_dict({"parallel": parallel})
        assert says in str(info.value)


def pipeline_world(backend: CommunicationBackend) -> dict[str, str]:
    """pp2 x tp2: the first stage takes the inputs, the last the targets; both checked on every stage."""
    model = hybrid_model(backend, {"pp": 2, "tp": 2}, "ddp")
    x, y = batch()
    mine = batch(seed=10 + backend.rank)
    return {
        "by_global_rank": refusal(lambda: model.train_step(mine, model.cross_entropy)),
        "targets": refusal(
            lambda: model.train_step((x, y.roll(model.mesh.coordinate("tp"))), model.cross_entropy)
        ),
        "same": refusal(lambda: model.train_step((x, y), model.cross_entropy)),
    }


def one_stage_differs_world(backend: CommunicationBackend) -> dict[str, str]:
    """pp2 x tp2, the tp group of the first stage (world ranks 0, 1) given other batches, that of the
    last stage (2, 3) one batch: the first inference and the first step, refused on every rank."""
    model = hybrid_model(backend, {"pp": 2, "tp": 2}, "ddp")
    x, y = batch()
    given = batch(seed=10 + backend.rank) if model.mesh.coordinate("pp") == 0 else (x, y)
    model.eval()
    with torch.no_grad():
        inference = refusal(lambda: model(given[0]))
    model.train()
    return {
        "inference": inference,
        "train_step": refusal(lambda: model.train_step(given, model.cross_entropy)),
    }


def test_pipeline_stages_refuse_batches_that_differ_over_tp() -> None:
    for rank, got in enumerate(run_world(4, pipeline_world, timeout=60)):
        first = rank - rank % 2
        assert f"tp rank 1 (world rank {first + 1}): inputs has other values" in got["by_global_rank"], rank
        assert FIX in got["by_global_rank"]
        assert f"tp rank 1 (world rank {first + 1}): targets has other values" in got["targets"], rank
        assert got["same"] == "accepted"


def test_one_stage_given_other_batches_over_tp_is_refused_on_every_rank_of_the_pipeline() -> None:
    """Only the first stage's tp ranks differ: its tp check refused on world ranks 0 and 1 while 2 and 3
    passed theirs and waited for 0 and 1 in the pipeline's check (in memory a CollectiveTimeoutError
    on ranks 2 and 3, on Gloo a hang). Now the first inference and step compare the batches over the
    pipeline's pp x tp ranks before the tp check: one StrategyError on every rank."""
    for rank, got in enumerate(run_world(4, one_stage_differs_world, timeout=60)):
        for kind, what in (("inference", "inputs"), ("train_step", "batches")):
            assert f"were given different {what}" in got[kind], (rank, kind, got[kind])
            assert "pp rank 0, tp rank 1 (world rank 1)" in got[kind], (rank, kind, got[kind])
            assert FIX in got[kind]


def later_step_differs_world(backend: CommunicationBackend) -> dict[str, str]:
    """pp2 x tp2, one batch everywhere at the first step and inference; at the second, the first stage's
    tp ranks (world ranks 0, 1) given other batches, the last stage's (2, 3) one batch."""
    model = hybrid_model(backend, {"pp": 2, "tp": 2}, "ddp")
    x, y = batch()
    given = batch(seed=10 + backend.rank) if model.mesh.coordinate("pp") == 0 else (x, y)
    got = {"step 1": refusal(lambda: model.train_step((x, y), model.cross_entropy))}
    got["step 2"] = refusal(lambda: model.train_step(given, model.cross_entropy))
    model.eval()
    with torch.no_grad():
        got["inference 1"] = refusal(lambda: model(x))
        got["inference 2"] = refusal(lambda: model(given[0]))
    return got


def test_one_stage_given_other_batches_at_a_later_step_is_refused_on_every_rank_of_the_pipeline() -> None:
    """The tp check of every step after the first ran over each stage's tp group alone: the first stage's
    ranks refused while the last stage's waited for them in the pipeline (in memory a
    CollectiveTimeoutError on ranks 2 and 3, on Gloo a hang). Now it runs over the pipeline's pp x tp
    ranks: one StrategyError on every rank."""
    for rank, got in enumerate(run_world(4, later_step_differs_world, timeout=60)):
        assert got["step 1"] == got["inference 1"] == "accepted", (rank, got)
        for kind, what in (("step 2", "batches"), ("inference 2", "inputs")):
            assert f"were given different {what}" in got[kind], (rank, kind, got[kind])
            assert "pp rank 0, tp rank 1 (world rank 1)" in got[kind], (rank, kind, got[kind])
            assert FIX in got[kind]


def exact_world(backend: CommunicationBackend) -> dict[str, str]:
    """Equal bits pass whatever their layout (a strided 1-d column or an expanded tensor too: they were
    read with a raw RuntimeError); one flipped bit, another order or another Python value
    is caught."""
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    r = backend.rank
    nested = {"a": [base.bfloat16(), torch.tensor(True)], "n": 3, "e": torch.empty(0, 2)}

    def check(*named: tuple[str, Any]) -> str:
        return refusal(lambda: check_same_on_tp("M", "inputs", named, backend, [0, 1]))

    flipped = base.clone()
    flipped.view(torch.int32)[4, 1] ^= 1 << 9  # one bit of one float
    return {
        "equal": check(("x", base.t().contiguous().t() if r else base), ("k", nested), ("s", base[1, 1])),
        # a column of the batch (targets = tokens[:, 0]) and an expanded tensor: 1-d, not contiguous
        "strided": check(("y", base[:, 0] if r else base[:, 0].contiguous()), ("e", base[0, 0].expand(4))),
        "bit": check(("x", flipped if r else base)),
        "order": check(("x", base[:, [1, 0, 2, 3, 4]] if r else base)),
        "python": check(("k", {**nested, "n": 3 + r})),
        "meta": check(("x", torch.empty(3, device="meta"))),
    }


def test_the_fingerprint_is_exact() -> None:
    for got in run_world(2, exact_world, timeout=60):
        assert got["equal"] == got["meta"] == got["strided"] == "accepted"
        assert "x has other values (same shape (6, 5), torch.float32)" in got["bit"]
        assert "x has other values" in got["order"]
        assert "k['n'] is 4, on tp rank 0 3" in got["python"]


def _eval_alone(backend: CommunicationBackend) -> None:
    model = TensorParallelModel(build(), backend, plan=PLAN)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    x, y = data(0)
    for step in range(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if backend.rank == 0 and step == 0:  # a DDP habit: evaluate on rank 0 only
            with torch.no_grad():
                model(x)


def test_one_rank_evaluating_alone_is_named_with_the_fix() -> None:
    """The other tp rank trains on: its collectives pair with the evaluation's until rank 0's next check
    meets its backward. Named with the cause and the fix, not as a bare mismatch of two all_reduces."""
    with pytest.raises(RankFailedError) as info:
        run_world(2, _eval_alone, timeout=60)
    said = str(info.value)
    assert (
        "rank 0 failed: StrategyError: TensorParallelModel: the check of the inputs on world rank 0" in said
    )
    assert "met another collective" in said and "evaluate on every rank" in said, said
