"""NumPy numbers where dtlab takes a count or a size: torch takes them (``operator.index``, ``float``),
so dtlab does too, and stores them as Python numbers (a NumPy integer in checkpoint metadata would not
be JSON). Bools stay refused: ``True`` is no count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.advise.precision import Precision
from dtlab.advise.spec import Candidate, ClusterSpec, ModelSpec, StrategyOptions
from dtlab.backends import Mesh, P2POp
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import save_checkpoint
from dtlab.compression import QSGD, OkTopk, PowerSGD
from dtlab.core.rng import seeded_init
from dtlab.errors import ArgumentError, DtlabError, integer, real
from dtlab.models import DDPModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ElasticOptimizer
from dtlab.testing import run_world
from dtlab.trainers import EarlyStopping, NonFiniteGuard

np = pytest.importorskip("numpy")


def _same(value: object, expected: object) -> None:
    assert type(value) is type(expected) and value == expected, (value, expected)


def test_the_shared_checks_take_numpy_numbers_and_refuse_bools() -> None:
    _same(integer(np.int64(3)), 3)
    _same(integer(np.uint8(7)), 7)
    _same(real(np.float32(0.5)), 0.5)
    _same(real(np.int32(2)), 2)
    for value in (True, np.True_, 2.0, "2", None, torch.tensor(2)):
        assert integer(value) is None, value
    for value in (False, np.float64("nan"), float("inf"), "0.5", None):
        assert real(value) is None, value


def test_configs_store_numpy_numbers_as_python_ones() -> None:
    configs: list[object] = [
        OkTopk(density=np.float32(0.25), tau=np.int64(2), warmup_steps=np.int16(1)),
        QSGD(levels=np.int8(8), bucket_size=np.int64(64), seed=np.int64(5)),
        PowerSGD(rank=np.int64(2), min_compression_rate=np.float32(2.0)),
        Precision(params=np.int64(2)),
        ModelSpec(layers=np.int64(2), hidden=np.int64(8), heads=np.int32(2)),
        ClusterSpec(ranks=np.int64(8), memory_gib=np.float32(80), latency_us=np.int64(0)),
        StrategyOptions(bucket_cap_mb=np.float32(25)),
        Candidate(strategy="ddp", dp=np.int64(2), tp=np.int64(1), pp=np.int64(1)),
        NonFiniteGuard(np.int64(3)),
        EarlyStopping(patience=np.int64(2), min_delta=np.float32(0.5)),
    ]
    for config in configs:
        for name, value in vars(config).items():
            assert not type(value).__module__.startswith("numpy"), (type(config).__name__, name, value)
    assert OkTopk(density=np.float32(0.25), tau=np.int64(2)) == OkTopk(density=0.25, tau=2)
    assert ModelSpec.from_parameters(np.int64(10**6), layers=np.int64(2), heads=2, vocab=256, seq_len=16)
    refused: list[tuple[type[Any], dict[str, object]]] = [
        (OkTopk, {"tau": True}),
        (OkTopk, {"warmup_steps": True}),  # was taken as 1
        (QSGD, {"levels": np.True_}),
        (PowerSGD, {"rank": True}),
        (ModelSpec, {"layers": True, "hidden": 8, "heads": 2}),
        (ClusterSpec, {"ranks": 8, "latency_us": float("nan")}),
        (EarlyStopping, {"patience": 1, "min_delta": True}),
    ]
    for cls, kwargs in refused:
        with pytest.raises(DtlabError, match="must be"):
            cls(**kwargs)


def test_strategies_and_checkpoints_take_numpy_numbers(tmp_path: Path) -> None:
    with seeded_init(0):
        plain = nn.Linear(4, 2)
    batch = torch.arange(16.0).reshape(4, 4) / 16

    def body(b: CommunicationBackend) -> None:
        for numpy_cap, py_cap in ((np.float32(0.5), 0.5), (np.int64(1), 1)):
            model = DDPModel(nn.Linear(4, 2), b, bucket_cap_mb=numpy_cap)
            _same(model.bucket_cap_mb, float(py_cap))
        with pytest.raises(ValueError, match="bucket_cap_mb must be a number"):
            DDPModel(nn.Linear(4, 2), b, bucket_cap_mb=np.True_)
        net = nn.Linear(4, 2)
        net.load_state_dict(plain.state_dict())
        z3 = ZeRO3Model(net, b, persistence_threshold=np.int64(4))
        z3(batch).sum().backward()  # the bias (2 elements) persists, the weight is sharded
        with pytest.raises(ValueError, match="persistence_threshold must be an int >= 0, got True"):
            ZeRO3Model(nn.Linear(4, 2), b, persistence_threshold=True)
        ddp = DDPModel(nn.Linear(4, 2), b)
        opt = ElasticOptimizer(
            DDPOptimizer(ddp, torch.optim.SGD, lr=0.1), commit_every=np.int64(2), copy_to=np.int64(1)
        )
        _same(opt.commit_every, 2)
        state = ddp.sharded_state_dict()
        args: dict[str, Any] = {"root": tmp_path, "backend": b, "model_state": state, "optim_state": None}
        save_checkpoint(**args, step=np.int64(7), rank_state={}, meta={}, keep_last=np.int64(2))

    run_world(np.int64(2), body, timeout=np.float32(60))
    written = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    assert written and any(7 in _values(m) for m in written), written
    assert (tmp_path / "step_00000007").is_dir()


def _values(tree: object) -> list[object]:
    if isinstance(tree, dict):
        return [v for x in tree.values() for v in _values(x)]
    if isinstance(tree, list):
        return [v for x in tree for v in _values(x)]
    return [tree]


def _backend_calls(b: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mesh = Mesh(b, {"dp": np.int64(-1), "tp": np.int32(1)})
    out["shape"] = mesh.shape
    out["rank_at"] = mesh.rank_at({"dp": np.int64(1)})
    group = b.split(color=np.int64(0), key=np.int64(-b.rank))
    out["split"] = None if group is None else group.rank
    out["new_group"] = b.new_group([np.int64(1), np.int64(0)]).rank  # type: ignore[union-attr]
    t = torch.full((2,), float(b.rank))
    b.broadcast(t, src=np.int64(1))
    out["broadcast"] = t.tolist()
    if b.rank == 0:
        b.send(torch.ones(1), dst=np.int64(1))
        b.batch_isend_irecv([P2POp.send(torch.ones(1), np.int64(1))])[0].wait()
    else:
        out["recv"] = b.recv(torch.zeros(1), src=np.int64(0))
        out["batch"] = b.batch_isend_irecv([P2POp.recv(torch.zeros(1), np.int64(0))])[0].wait()
    refused = {
        "mesh": lambda: Mesh(b, {"dp": True, "tp": 2}),
        "rank_at": lambda: mesh.rank_at({"dp": True}),
        "color": lambda: b.split(color=np.True_),
        "key": lambda: b.split(color=0, key=1.0),
        "new_group": lambda: b.new_group([0, 1.5]),
        "src": lambda: b.broadcast(t, src=True),
    }
    out["refused"] = {}
    for name, call in refused.items():
        try:
            call()
        except ArgumentError as exc:
            out["refused"][name] = str(exc)
    return out


def test_meshes_groups_roots_and_peers_take_numpy_integers_as_torch_does() -> None:
    # torch.distributed takes them (operator.index); dtlab's shared checks too; a bool is no rank
    rank0, rank1 = run_world(2, _backend_calls, timeout=60)
    _same(rank0["shape"]["dp"], 2)  # stored as Python ints
    _same(rank0["shape"]["tp"], 1)
    assert rank0["shape"] == {"dp": 2, "tp": 1} and rank0["rank_at"] == 1
    assert (rank0["split"], rank1["split"]) == (1, 0)  # numbered by key = -rank
    assert (rank0["new_group"], rank1["new_group"]) == (1, 0)
    assert rank0["broadcast"] == rank1["broadcast"] == [1.0, 1.0]
    assert rank1["recv"] == 0 and rank1["batch"] == 0
    for res in (rank0, rank1):
        assert set(res["refused"]) == {"mesh", "rank_at", "color", "key", "new_group", "src"}, res["refused"]
        assert "dp=True" in res["refused"]["mesh"] and "src=True" in res["refused"]["src"]
