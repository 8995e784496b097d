"""Checkpoints from elsewhere: validated before allocation, read in bounded pieces, never through a link
that leaves the checkpoint directory; each problem one named error (exit 2) or a fallback to the newest
intact step. The command lines and the property test run under an address-space cap
(``tests/_capped.py``) far below what the crafted inputs would take (4 GiB sparse files, a shape of
``[2**40]``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import (
    find_resume_checkpoint,
    full_tensors_from_shards,
    read_checkpoint,
    save_checkpoint,
)
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError, RankFailedError
from dtlab.models import DDPModel
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world
from tests._capped import CAP, _limit, run_cli
from tests.checkpoint_cases import flat_shard

FULL = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([7.0, 8.0, 9.0])}


def _save(backend: CommunicationBackend, root: str) -> None:
    for step in (1, 2):
        shard = flat_shard(FULL, backend.rank, backend.world_size, float(step))
        meta = {"trainer": {"step": step}}
        save_checkpoint(root, step, backend, shard, None, {"r": torch.zeros(2)}, meta, keep_last=2)


def make_checkpoint(root: Path) -> Path:
    run_world(2, _save, str(root))
    return root


def _strategies(backend: CommunicationBackend) -> tuple[DDPModel, DDPOptimizer]:
    torch.manual_seed(0)
    model = DDPModel(nn.Linear(3, 2), backend)
    return model, DDPOptimizer(model, torch.optim.AdamW, lr=0.1)


def _save_strategies(backend: CommunicationBackend, root: str) -> None:
    model, opt = _strategies(backend)
    for step in (1, 2):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        rng = {"r": torch.zeros(2)}
        meta = {"trainer": {"step": step}}
        save_checkpoint(root, step, backend, model.sharded_state_dict(), opt.sharded_state_dict(), rng, meta)


def make_strategy_checkpoint(root: Path) -> Path:
    """A checkpoint of a real DDP model and AdamW (entries, scalars, state keys, param groups)."""
    run_world(2, _save_strategies, str(root))
    return root


def load_into_strategies(backend: CommunicationBackend, model: list[ShardedState], optim: Any) -> None:
    m, opt = _strategies(backend)
    m.load_sharded_state_dict(model)
    if optim:
        opt.load_sharded_state_dict(optim)


def _sparse(path: Path, size: int = 4 << 30) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _edit_meta(step: Path, edit: object) -> None:
    meta = json.loads((step / "meta.json").read_text())
    edit(meta)  # type: ignore[operator]
    (step / "meta.json").write_text(json.dumps(meta))


def test_crafted_checkpoints_are_one_named_error_under_a_memory_cap(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    outside = tmp_path / "outside"
    outside.mkdir()
    big = _sparse(outside / "big.bin")
    secret = outside / "secret.txt"
    secret.write_text("TOP-SECRET-LINE\n" * 20)
    cases: list[tuple[str, str]] = []

    def variant(name: str, want: str) -> Path:
        root = tmp_path / name
        shutil.copytree(base, root, symlinks=True)
        cases.append((name, want))
        return root / "step_00000002"

    s = variant("shard_4g", "is truncated or extended: 4294967296 bytes")
    os.unlink(s / "model_rank00000.safetensors")
    _sparse(s / "model_rank00000.safetensors")
    s = variant("shard_link", "resolves to")
    os.unlink(s / "model_rank00001.safetensors")
    os.symlink(big, s / "model_rank00001.safetensors")
    s = variant("latest_link", "latest is a symbolic link; refusing to follow it")
    os.unlink(s.parent / "latest")
    os.symlink(big, s.parent / "latest")
    s = variant("latest_4g", "latest is 4,294,967,296 bytes, more than the 4,096 dtlab reads")
    os.unlink(s.parent / "latest")
    _sparse(s.parent / "latest")
    s = variant("latest_text", "does not name a step directory")
    os.unlink(s.parent / "latest")
    shutil.copy(secret, s.parent / "latest")
    s = variant("meta_link", "resolves to")
    shutil.copy(s / "meta.json", outside / "meta.json")
    os.unlink(s / "meta.json")
    os.symlink(outside / "meta.json", s / "meta.json")
    s = variant("step_link", "resolves to")
    shutil.copytree(s, outside / "step_00000002")
    shutil.rmtree(s)
    os.symlink(outside / "step_00000002", s)

    def shape(value: object) -> object:
        def edit(meta: dict) -> None:  # type: ignore[type-arg]
            for entry in meta["ranks"]:
                entry["model"]["entries"]["w"]["shape"] = value

        return edit

    _edit_meta(
        variant("shape_2_40", "cover only 12 elements of 'w', fewer than the 1099511627776"), shape([2**40])
    )
    _edit_meta(variant("shape_2_28", "cover only 12 elements of 'w'"), shape([2**28]))
    _edit_meta(variant("shape_str", "entry 'w' has shape '3,4', not a list"), shape("3,4"))

    def cplx(meta: dict) -> None:  # type: ignore[type-arg]
        meta["ranks"][0]["model"]["entries"]["b"]["dtype"] = "complex128"

    _edit_meta(variant("complex", "entry 'b' has dtype 'complex128'"), cplx)
    s = variant("deep", "nested deeper than JSON can be parsed")
    (s / "meta.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    s = variant("meta_4g", "meta.json is 4,294,967,296 bytes, more than the 268,435,456 dtlab reads")
    os.unlink(s / "meta.json")
    _sparse(s / "meta.json")
    s = variant("fifo", "is not a regular file")
    os.unlink(s / "state_rank00000.safetensors")
    os.mkfifo(s / "state_rank00000.safetensors")

    runs = run_cli(
        [["consolidate", name, "-o", f"{name}.out"] for name, _ in cases], cwd=tmp_path, timeout=300
    )
    for (name, want), run in zip(cases, runs, strict=True):
        err = run["stderr"]
        assert run["rc"] == 2 and want in err, (name, run)
        assert "Traceback" not in err and "TOP-SECRET" not in err and len(err) < 2000, (name, err)
        assert not (tmp_path / f"{name}.out").exists()
    assert os.path.getsize(big) == 4 << 30 and secret.read_text().startswith("TOP-SECRET")


def test_a_resume_falls_back_past_untrustworthy_step_directories(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ck")
    step2 = root / "step_00000002"
    (step2 / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    point = find_resume_checkpoint(root)
    assert point.checkpoint is not None and point.checkpoint.step == 1
    assert any("nested deeper than JSON can be parsed" in n for n in point.notes)
    # a newest step directory that is a link leaving the checkpoint directory is not taken either
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "step_00000001", elsewhere)
    _edit_meta(elsewhere, lambda meta: meta.update(step=3))
    (root / "step_00000003").symlink_to(elsewhere)
    (root / "latest").write_text("step_00000003\n")
    point = find_resume_checkpoint(root)
    assert point.checkpoint is not None and point.checkpoint.step == 1
    assert any("resolves to" in n and "outside" in n for n in point.notes)
    allowed = find_resume_checkpoint(root, allow_outside=True)
    assert allowed.checkpoint is not None and allowed.checkpoint.path.name == "step_00000003"


def test_a_param_group_that_is_not_an_object_in_another_rank_s_shard_is_refused(tmp_path: Path) -> None:
    """meta.json's ranks[1].optim.param_groups[0] = null (the property test's draw): refused as the
    checkpoint's fault on every rank, not a TypeError from comparing the groups' options."""
    root = make_strategy_checkpoint(tmp_path / "ck")
    _edit_meta(
        root / "step_00000002", lambda meta: meta["ranks"][1]["optim"]["param_groups"].__setitem__(0, None)
    )
    ckpt = read_checkpoint(root)
    try:
        run_world(2, load_into_strategies, ckpt.model, ckpt.optim, timeout=60)
    except RankFailedError as exc:
        said = str(exc)
    assert "CheckpointError" in said and "param_groups=[None]" in said, said


_PROPERTY = r"""
import json, os, shutil, struct, hashlib, sys
from pathlib import Path
from hypothesis import given, settings, strategies as st, HealthCheck
from dtlab.checkpoint import find_resume_checkpoint, read_checkpoint, full_tensors_from_shards
from dtlab.errors import CheckpointError, RankFailedError
from dtlab.testing import run_world
from tests.test_untrusted_checkpoint import load_into_strategies, make_strategy_checkpoint

base = make_strategy_checkpoint(Path(sys.argv[1]) / "base")
work = Path(sys.argv[1]) / "work"
values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.sampled_from([2**28, 2**40, -1, 0, 1e12, "complex128", "float32", "3,4", "int8"]),
    st.floats(allow_nan=False), st.text(max_size=20), st.lists(st.integers(-5, 2**41), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)

def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))

def put(tree, path, value):
    if not path:
        return value
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return tree

def header(data):
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8:8 + n])

@settings(max_examples=int(sys.argv[2]), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def prop(data):
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    step = work / "step_00000002"
    meta = json.loads((step / "meta.json").read_text())
    if data.draw(st.booleans()):  # a shard header, with meta.json's size and checksum made to match
        name = data.draw(st.sampled_from(sorted(meta["files"])))
        raw = (step / name).read_bytes()
        n, head = header(raw)
        tpaths = [p for p in paths(head) if p and p[0] != "__metadata__"]
        head = put(head, data.draw(st.sampled_from(tpaths)), data.draw(values))
        text = json.dumps(head).encode()
        raw = struct.pack("<Q", len(text)) + text + raw[8 + n:]
        (step / name).write_bytes(raw)
        meta["files"][name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    else:
        meta = put(meta, data.draw(st.sampled_from(list(paths(meta)))), data.draw(values))
    (step / "meta.json").write_text(json.dumps(meta))
    try:
        ckpt = read_checkpoint(step, with_optimizer=True)
        full_tensors_from_shards(ckpt.model)
        run_world(1, load_into_strategies, ckpt.model, ckpt.optim, timeout=30)
    except CheckpointError:
        pass
    except RankFailedError as exc:  # the load on the rank: a named error, never another exception
        assert isinstance(exc.__cause__, CheckpointError), repr(exc.__cause__)
    point = find_resume_checkpoint(work)
    assert point.checkpoint is not None and point.checkpoint.step in (1, 2), point.notes
    if point.checkpoint.step == 1:
        assert any("fell back to step_00000001" in n for n in point.notes), point.notes

prop()
print("ok")
"""


def test_property_mutated_meta_and_shard_headers_never_traceback_nor_blow_memory(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PROPERTY, str(tmp_path), "120"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        preexec_fn=lambda: _limit(CAP),
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-6000:]


def _flat_save(backend: CommunicationBackend, root: str) -> None:
    full = {"w": torch.arange(12.0)}
    save_checkpoint(root, 1, backend, flat_shard(full, backend.rank, 2), None, {"r": torch.zeros(2)}, {})


@pytest.mark.parametrize("verify_all", [True, False])
def test_an_entry_name_in_a_crafted_meta_is_named_by_a_bounded_summary(
    tmp_path: Path, verify_all: bool
) -> None:
    """Before, with verify_all=False (every Trainer rank but 0): a 12,000-character entry name whose
    shape differs between two shards was quoted whole (a message of 12,050 characters)."""
    run_world(2, _flat_save, str(tmp_path))
    meta_path = tmp_path / "step_00000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for i, rank in enumerate(meta["ranks"]):
        entries = rank["model"]["entries"]
        entries["SECRET" * 2000] = {**entries.pop("w"), "shape": [12 + i]}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        full_tensors_from_shards(read_checkpoint(tmp_path, verify_all=verify_all).model)
    said = str(info.value)
    assert "a str of 12,000 characters" in said and len(said) < 600, said
