"""A torch user's habits under DDP, ZeRO-1/2/3 and FSDP work as in torch or stop with an error naming
the fix, never silently wrong: checked against single-process training on the same global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sync_bn_cases import compare as sync_bn_compare
from sync_bn_cases import reference as sync_bn_reference
from test_strategies_helpers import STRATEGIES, make_module, max_rel_error, wrap
from torch import nn
from torch_habits_cases import (
    all_cases,
    clip_case,
    clip_reference,
    counts_case,
    grad_sync_case,
    grad_sync_reference,
    groups_case,
    groups_reference,
    one_rank_eval_case,
    opt_class,
    requires_grad_case,
)

from dtlab.core.rng import seeded_init
from dtlab.errors import CollectiveMismatchError, RankFailedError, StrategyError
from dtlab.testing import run_world

#: strategies where param.grad holds the whole averaged gradient after backward
WHOLE_GRADS = ("ddp",)


@pytest.fixture(scope="module")
def clipped() -> tuple[dict[str, torch.Tensor], list[float]]:
    return clip_reference()


def check_clip(
    name: str, res: dict[str, Any], ref: tuple[dict[str, torch.Tensor], list[float]], where: str
) -> None:
    state, norms = ref
    assert max(norms) > 0.05 * 2, "clipping must be active in the reference"
    assert max_rel_error(res["state"], state) <= 1e-5, where
    if name in WHOLE_GRADS:  # torch's own function: the global norm, clipped
        assert res["verdicts"] == ["ran"] and res["torch_norms"] == pytest.approx(norms, rel=1e-5), where
        assert res["clip_value"] == "ran" and res["plain_step"] == "ran", where
    else:  # refused naming opt.clip_grad_norm_, and opt.clip_grad_norm_ is right
        assert res["verdicts"] == ["refused"] and res["norms"] == pytest.approx(norms, rel=1e-5), where
        assert res["clip_value"] == "refused" and res["plain_step"] == "refused", where


@pytest.mark.parametrize("name", STRATEGIES)
def test_torch_clip_gives_the_global_norm_or_names_opt_clip(
    name: str, clipped: tuple[dict[str, torch.Tensor], list[float]]
) -> None:
    for rank, res in enumerate(run_world(2, clip_case, name, timeout=30)):
        check_clip(name, res, clipped, f"{name} rank {rank}")


def test_zero1_all_reduce_keeps_torch_clip_right(
    clipped: tuple[dict[str, torch.Tensor], list[float]],
) -> None:
    for res in run_world(2, clip_case, "zero1", timeout=30, gradient_sync="all_reduce"):
        check_clip("ddp", res, clipped, "zero1 all_reduce")


def check_requires_grad(res: dict[str, str], where: str) -> None:
    assert res == {"unfreeze": "refused", "freeze": "refused"}, where


@pytest.mark.parametrize("name", STRATEGIES)
def test_requires_grad_changed_after_wrapping_is_refused(name: str) -> None:
    for res in run_world(2, requires_grad_case, name, timeout=30):
        check_requires_grad(res, name)


def check_grad_sync(res: dict[str, Any], ref: dict[str, torch.Tensor], where: str) -> None:
    assert max_rel_error(res["state"], ref) <= 1e-5, where
    one = res["one_backward_bytes"]
    assert one > 0 and res["accumulated_bytes"] == [one, one], where


@pytest.mark.parametrize("name", STRATEGIES)
def test_require_backward_grad_sync_counted_in_bytes(name: str) -> None:
    ref = grad_sync_reference()
    for res in run_world(2, grad_sync_case, name, timeout=30):
        check_grad_sync(res, ref, name)


@pytest.fixture(scope="module")
def grouped() -> dict[str, dict[str, torch.Tensor]]:
    return {kind: groups_reference(kind) for kind in ("lambda", "onecycle")}


def check_groups(res: dict[str, Any], ref: dict[str, torch.Tensor], where: str) -> None:
    for run in ("trained", "to_plain", "from_plain"):
        assert max_rel_error(res[run], ref) <= 1e-5, f"{where}: {run}"


@pytest.mark.parametrize("kind", ["lambda", "onecycle"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_param_groups_schedulers_and_plain_state_dicts(
    name: str, kind: str, grouped: dict[str, dict[str, torch.Tensor]]
) -> None:
    for rank, res in enumerate(run_world(2, groups_case, name, kind, timeout=30)):
        check_groups(res, grouped[kind], f"{name}/{kind} rank {rank}")


def check_counts(res: dict[str, Any], where: str) -> None:
    plain = make_module()
    want = [(tuple(p.shape), p.dim(), p.numel()) for p in plain.parameters()]
    assert res["seen"] == [want, want, want], where
    assert res["count"] == sum(p.numel() for p in plain.parameters()), where
    assert res["keys"] == sorted(plain.state_dict()), where


@pytest.mark.parametrize("name", STRATEGIES)
def test_parameter_counts_and_dims_are_the_plain_modules(name: str) -> None:
    for res in run_world(2, counts_case, name, timeout=30):
        check_counts(res, name)


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_one_rank_eval_is_named_as_a_mismatch(name: str) -> None:
    """In-memory ranks: the other rank at a barrier; the world names both calls at once (a mismatch,
    not the timeout's CollectiveTimeoutError)."""
    with pytest.raises(CollectiveMismatchError) as info:
        run_world(2, one_rank_eval_case, name, "barrier", timeout=60)
    assert "all_gather" in str(info.value) and "barrier" in str(info.value)


def _alone_then_train(backend: Any, name: str, call: str) -> None:
    """Rank 0 evaluates (or takes the state dict) alone between training steps; the others train on."""
    model = wrap(name, make_module(), backend)
    opt = opt_class(name)(model, torch.optim.SGD, lr=0.1)
    x = torch.ones(2, 6)
    for step in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if backend.rank == 0 and step == 0:
            alone = {
                "forward": lambda: model(x),
                "state_dict": model.state_dict,
                "opt.state_dict": opt.state_dict,
            }
            with torch.no_grad():
                alone[call]()


@pytest.mark.parametrize(
    "name,call", [("zero3", "forward"), ("fsdp", "state_dict"), ("zero2", "opt.state_dict")]
)
def test_one_rank_eval_while_the_others_train_is_named(name: str, call: str) -> None:
    """The others go on training: their gathers pair with rank 0's evaluation (or state dict) and the
    ranks fall out of step at a later gather (ZeRO-2's opt.state_dict() meets their reduce-scatter at
    once). Named on rank 0 with the cause and the fix, not as a bare mismatch of two collectives."""
    with pytest.raises(RankFailedError) as info:
        run_world(2, _alone_then_train, name, call, timeout=60)
    said = str(info.value)
    assert "rank 0 failed: StrategyError" in said, said
    if call == "opt.state_dict":
        assert "ZeRO2Optimizer.state_dict() on rank 0 did not meet the other ranks" in said, said
    else:
        assert "made on this rank since the last synchronized" in said, said
    assert ("every rank must call forward" if call == "forward" else "if rank == 0: torch.save(sd") in said


def test_zero3_says_when_nothing_is_sharded() -> None:
    def build(backend: Any) -> int:
        wrap("zero3", make_module(), backend, persistence_threshold=100_000)
        return 0

    with pytest.warns(UserWarning, match="persistence_threshold=100000 keeps every parameter whole"):
        run_world(2, build, timeout=30)


def test_torch_constructor_options_are_named_with_the_fix() -> None:
    """torch DDP's ``device_ids=[local_rank]`` (and FSDP2's ``mp_policy=``, ``init_sync=False``...) stopped
    with Python's bare 'DataParallelModel.__init__() got an unexpected keyword argument': each now names
    the wrapper, the option and what to do instead (still a TypeError). ``model.join()`` (uneven inputs)
    raised a bare AttributeError: it names the fix (the same number of batches on every rank)."""

    def build(backend: Any) -> list[str]:
        said = []
        for name, option, value in (
            ("ddp", "device_ids", [0]),
            ("fsdp", "mp_policy", "bf16"),
            ("zero1", "init_sync", False),
        ):
            with pytest.raises(TypeError) as info:
                wrap(name, make_module(), backend, **{option: value})
            said.append(str(info.value))
        # torch's defaults and its layout or tracing hints ask for what the strategy does anyway: taken
        same = {
            "device_ids": None,
            "output_device": None,
            "static_graph": True,
            "gradient_as_bucket_view": True,
        }
        wrap("ddp", make_module(), backend, **same, init_sync=True, process_group=None)
        wrap("fsdp", make_module(), backend, mp_policy=None, mesh=None)
        with pytest.raises(StrategyError) as joined:  # torch DDP's uneven inputs: AttributeError before
            wrap("zero3", make_module(), backend).join()
        # a backend's name as torch's init_process_group takes it, or no module: named before any read
        # (a raw AttributeError before: 'str' object has no attribute 'named_parameters' / 'device')
        classes = ("DDPModel", "ZeRO1Model", "ZeRO2Model", "ZeRO3Model", "FSDPModel")
        for name, cls in zip(STRATEGIES, classes, strict=True):
            with pytest.raises(TypeError, match=f"^{cls} wraps a torch.nn.Module, got str$"):
                wrap(name, "net", backend)  # type: ignore[arg-type]
            with pytest.raises(
                TypeError, match=f"^{cls} needs a dtlab CommunicationBackend, got str: pass init_"
            ):
                wrap(name, make_module(), "gloo")  # type: ignore[arg-type]
        return [*said, str(joined.value)]

    (said,) = run_world(1, build, timeout=30)
    assert "ZeRO3Model has no join()" in said[3] and "dtlab.data.DistributedSampler" in said[3], said[3]
    assert "DDPModel(device_ids=...)" in said[0] and "module.to(backend.device)" in said[0], said[0]
    assert "FSDPModel(mp_policy=...)" in said[1] and "torch.autocast" in said[1], said[1]
    assert "ZeRO1Model(init_sync=...)" in said[2] and "drop it" in said[2], said[2]


def test_zero3_names_tied_weights_when_they_keep_everything_whole() -> None:
    """At persistence_threshold=0 only tied parameters stay whole: the warning names them and the fix
    (not the threshold, which is already 0)."""

    def build(backend: Any) -> int:
        with seeded_init(0):
            emb = nn.Embedding(16, 8)
            head = nn.Linear(8, 16, bias=False)
        head.weight = emb.weight
        wrap("zero3", nn.Sequential(emb, head), backend, persistence_threshold=0)
        return 0

    with pytest.warns(UserWarning, match=r"threshold=0 \(0.weight\) is used by more than one module") as rec:
        run_world(2, build, timeout=30)
    assert all("pass persistence_threshold=0" not in str(w.message) for w in rec)


def test_all_habits_on_gloo(
    clipped: tuple[dict[str, torch.Tensor], list[float]], grouped: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Every habit under every strategy in ONE spawned 2-process Gloo world (OneCycleLR, which only
    differs from LambdaLR in the options it drives, on in-memory ranks only)."""
    from dtlab.testing import spawn_world

    results = spawn_world(2, all_cases, backend="gloo", timeout=240)
    sync_ref, bn_ref = grad_sync_reference(), sync_bn_reference(2)
    for rank, res in enumerate(results):
        for name in STRATEGIES:
            where = f"{name} on gloo, rank {rank}"
            check_clip(name, res[f"clip/{name}"], clipped, where)
            check_requires_grad(res[f"requires_grad/{name}"], where)
            check_grad_sync(res[f"grad_sync/{name}"], sync_ref, where)
            check_counts(res[f"counts/{name}"], where)
            check_groups(res[f"groups/{name}/lambda"], grouped["lambda"], f"{where} lambda")
        assert res["sync_bn/initialized"] is True
        for name in ("ddp", "fsdp"):  # SyncBatchNorm: tests/test_sync_batchnorm.py
            sync_bn_compare(res[f"sync_bn/{name}"], bn_ref, 2, f"{name} SyncBatchNorm on gloo, rank {rank}")
    # rank 0 evaluated alone while rank 1 had left: named after forward_wait_s (3 s), not 300 s
    alone = results[0]["one_rank_eval/zero3"]
    assert alone["named"] is True and alone["seconds"] < 10, alone
    # rank 0 saved alone (if rank == 0: torch.save(model.state_dict())): named after 1 s; it hung before
    alone = results[0]["one_rank_state/fsdp"]
    assert alone["named"] is True and alone["seconds"] < 5, alone
    said = alone["message"]
    assert "model.state_dict() waited 1 s" in said and "if rank == 0: torch.save(sd" in said, said


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.emb(x))


def _tied_shards(backend: Any, name: str) -> Any:
    from dtlab.models import FSDPModel, ZeRO3Model

    module = _Tied()
    model = (
        ZeRO3Model(module, backend, persistence_threshold=0)
        if name == "zero3"
        else FSDPModel(module, backend)
    )
    return model.sharded_state_dict()


# zero3 keeps the tied weight whole on purpose here, which it warns about
@pytest.mark.filterwarnings("ignore:ZeRO3Model.*tied weights:UserWarning")
@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_consolidated_checkpoint_keeps_tied_keys(name: str) -> None:
    from dtlab.checkpoint import full_tensors_from_shards

    shards = run_world(2, _tied_shards, name, timeout=30)
    full = full_tensors_from_shards(shards)
    plain = _Tied()
    assert sorted(full) == sorted(plain.state_dict())
    fresh = _Tied()
    fresh.load_state_dict(full)  # strict: every key the plain module has
    assert torch.equal(fresh.lm_head.weight, full["emb.weight"])
