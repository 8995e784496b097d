"""Loading a checkpoint reads what a rank keeps: every file is verified (size, SHA-256, header) by
streaming it without holding it, and a rank materialises only the saved pieces that overlap its own part
(``LoadedCheckpoint.reads`` counts bytes read and bytes of tensor data). Exact counts per loading rank
for FSDP 4 -> 4, ZeRO-3 4 -> 2, DDP -> FSDP and tp2 x dp2 -> tp2 x dp2 (model and AdamW state)."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tensor_helpers import build, initial_state
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards, read_checkpoint, save_checkpoint
from dtlab.core.rng import seeded_init
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError
from dtlab.models import DDPModel, FSDPModel, TensorParallelModel, ZeRO3Model, transformer_plan
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world
from tests.checkpoint_cases import flat_shard


def _nbytes(state: ShardedState) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors.values())


def _files(root: Path) -> dict[str, int]:
    meta = json.loads((root / "meta.json").read_text())
    return {name: info["bytes"] for name, info in meta["files"].items()}


# ---------------------------------------------------------------- verification holds nothing


def _save_big(backend: CommunicationBackend, root: str) -> None:
    gen = torch.Generator().manual_seed(0)
    full = {f"t{i}": torch.randn(1 << 20, generator=gen) for i in range(4)}  # 16 MiB in all
    save_checkpoint(root, 1, backend, flat_shard(full, backend.rank, 2), None, {"r": torch.zeros(2)}, {})


def test_read_checkpoint_verifies_every_file_without_holding_it(tmp_path: Path) -> None:
    """Before: read_checkpoint held every file's bytes and tensors (peak 25.2 MB of Python buffers for
    this 16 MiB, 2-rank checkpoint, files read twice). Now: each file is streamed through SHA-256 once,
    nothing held; tensors are read when used."""
    run_world(2, _save_big, str(tmp_path))
    step = tmp_path / "step_00000001"
    tracemalloc.start()
    try:
        ckpt = read_checkpoint(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * (1 << 20), peak  # a piece being hashed, the headers
    assert ckpt.reads.tensor_bytes == 0
    assert ckpt.reads.bytes_read == sum(_files(step).values()) and len(ckpt.reads.verified) == 4
    full = full_tensors_from_shards(ckpt.model)  # the tensors, read now
    gen = torch.Generator().manual_seed(0)
    assert all(torch.equal(full[f"t{i}"], torch.randn(1 << 20, generator=gen)) for i in range(4))
    assert ckpt.reads.tensor_bytes == 16 << 20


def _rewrite(path: Path, head: dict[str, Any], data: bytes) -> None:
    """Write a safetensors file and make meta.json's size and checksum match it."""
    import hashlib

    text = json.dumps(head).encode()
    raw = struct.pack("<Q", len(text)) + text + data
    path.write_bytes(raw)
    meta_path = path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][path.name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    meta_path.write_text(json.dumps(meta))


def _save_small(backend: CommunicationBackend, root: str) -> None:
    full = {"w": torch.arange(12, dtype=torch.float32)}
    save_checkpoint(root, 1, backend, flat_shard(full, backend.rank, 2), None, {"r": torch.zeros(2)}, {})


@pytest.mark.parametrize(
    ("head", "data", "said"),
    [
        (
            {
                "w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]},
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
            },
            24,
            "starts at byte 16 of the data, not 24",
        ),
        (
            {"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}},
            32,
            "cover 24 bytes of data, the file holds 32",
        ),
        ({"w": {"dtype": "F32", "shape": [7], "data_offsets": [0, 24]}}, 24, "has 24 bytes for shape [7]"),
        (
            {"w": {"dtype": "C64", "shape": [6], "data_offsets": [0, 24]}},
            24,
            "a dtype safetensors does not define",
        ),
        ({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 2**70]}}, 24, "data_offsets that are not"),
        (
            {"w": {"dtype": "I32", "shape": [6], "data_offsets": [0, 24]}},
            24,
            "is float32 but its tensor is int32",
        ),
        ({"v": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}, 24, "entry 'w' has no tensor"),
        ([1, 2], 0, "header is not a JSON object"),
    ],
)
def test_a_crafted_header_with_a_matching_checksum_is_one_checkpoint_error(
    tmp_path: Path, head: Any, data: int, said: str
) -> None:
    run_world(2, _save_small, str(tmp_path))
    _rewrite(tmp_path / "step_00000001" / "model_rank00001.safetensors", head, bytes(data))
    with pytest.raises(CheckpointError, match=said.replace("[", r"\[").replace("]", r"\]")):
        read_checkpoint(tmp_path)
    lazy = read_checkpoint(tmp_path, verify_all=False)  # the file is not read until it is used
    assert lazy.reads.bytes_read == 0
    with pytest.raises(CheckpointError, match=said.replace("[", r"\[").replace("]", r"\]")):
        full_tensors_from_shards(lazy.model)


def test_a_tensor_name_in_a_crafted_header_is_named_by_a_bounded_summary(tmp_path: Path) -> None:
    """Before: the error quoted the header's 10,000-character name whole (safetensors' message)."""
    run_world(2, _save_small, str(tmp_path))
    name = "SECRET" * 2000
    head = {name: {"dtype": "F32", "shape": [6], "data_offsets": [4, 28]}}
    _rewrite(tmp_path / "step_00000001" / "model_rank00000.safetensors", head, bytes(24))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path)
    said = str(info.value)
    assert "a str of 12,000 characters" in said and len(said) < 600, said


def test_a_header_length_past_the_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    run_world(2, _save_small, str(tmp_path))
    path = tmp_path / "step_00000001" / "state_rank00000.safetensors"
    raw = struct.pack("<Q", 2**62) + b"{}"
    path.write_bytes(raw)
    import hashlib

    meta = json.loads((path.parent / "meta.json").read_text())
    meta["files"][path.name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (path.parent / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="header length 4611686018427387904 exceeds the file"):
        read_checkpoint(tmp_path)


def test_a_file_changed_after_it_was_verified_is_refused(tmp_path: Path) -> None:
    run_world(2, _save_small, str(tmp_path))
    ckpt = read_checkpoint(tmp_path)
    path = tmp_path / "step_00000001" / "model_rank00000.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    time.sleep(0.05)  # past the file system's clock tick of the save
    path.write_bytes(bytes(raw))  # written in place after the check: another modification time
    with pytest.raises(CheckpointError, match="changed after it was verified"):
        full_tensors_from_shards(ckpt.model)


def test_a_file_written_while_it_is_hashed_is_refused(tmp_path: Path, monkeypatch: Any) -> None:
    """The identity of the file (device, inode, size, times) is taken before the hash and compared
    after it: a write during the hash is refused even where the bytes hashed were the original ones."""
    import os

    run_world(2, _save_small, str(tmp_path))
    path = tmp_path / "step_00000001" / "model_rank00001.safetensors"
    read = os.read

    def read_then_write(fd: int, n: int) -> bytes:
        data = read(fd, n)
        time.sleep(0.05)
        os.utime(path)  # what a writer does to the file's times, its bytes left as they were
        return data

    monkeypatch.setattr(os, "read", read_then_write)
    with pytest.raises(
        CheckpointError, match=r"model_rank00001\.safetensors changed while it was being verified"
    ):
        read_checkpoint(tmp_path / "step_00000001", verify_all=False).model[1].tensors["w"]


def test_loaded_shards_can_be_copied_and_pickled(tmp_path: Path) -> None:
    """Before: a loaded checkpoint's shards held tensors; now lazy ones, which copy and pickle too."""
    import copy
    import pickle

    run_world(2, _save_small, str(tmp_path))
    ckpt = read_checkpoint(tmp_path)
    for shards in (copy.deepcopy(ckpt.model), pickle.loads(pickle.dumps(ckpt.model))):
        assert torch.equal(full_tensors_from_shards(shards)["w"], torch.arange(12, dtype=torch.float32))
    assert torch.equal(pickle.loads(pickle.dumps(ckpt.rank_states))[1]["r"], torch.zeros(2))


# ---------------------------------------------------------------- what each rank reads


def _mlp() -> nn.Module:
    with seeded_init(0):
        return nn.Sequential(nn.Linear(32, 40), nn.ReLU(), nn.Linear(40, 24))


def _strategies(kind: str, backend: CommunicationBackend) -> tuple[Any, Any]:
    if kind == "ddp":
        model: Any = DDPModel(_mlp(), backend)
        return model, DDPOptimizer(model, torch.optim.AdamW, lr=0.01)
    if kind == "zero3":
        model = ZeRO3Model(_mlp(), backend, persistence_threshold=0)
    else:
        model = FSDPModel(_mlp(), backend)
    return model, ZeRO3Optimizer(model, torch.optim.AdamW, lr=0.01)


def _train_and_save(backend: CommunicationBackend, root: str, kind: str) -> dict[str, torch.Tensor]:
    model, opt = _strategies(kind, backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, generator=gen).chunk(backend.world_size)[backend.rank]
    model(x).square().mean().backward()
    opt.step()
    save_checkpoint(
        root, 1, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {"r": torch.zeros(2)}, {}
    )
    return dict(model.full_state_dict())


def _load(backend: CommunicationBackend, root: str, kind: str) -> dict[str, Any]:
    model, opt = _strategies(kind, backend)
    ckpt = read_checkpoint(root, verify_all=False)
    model.load_sharded_state_dict(ckpt.model)
    opt.load_sharded_state_dict(ckpt.optim)
    reads = ckpt.reads
    return {
        "held": _nbytes(model.sharded_state_dict()) + _nbytes(opt.sharded_state_dict()),
        "mine": [model.sharded_state_dict().metadata, opt.sharded_state_dict().metadata],
        "bytes_read": reads.bytes_read,
        "tensor_bytes": reads.tensor_bytes,
        "files": set(reads.verified),
        "full": dict(model.full_state_dict()),
    }


def _overlapping(step: Path, mine: list[dict[str, Any]]) -> set[str]:
    """The saved files holding a flat piece that overlaps one of this rank's entries."""
    meta = json.loads((step / "meta.json").read_text())
    out = set()
    for kind, md in zip(("model", "optim"), mine, strict=True):
        for key, e in md["entries"].items():
            for saved in meta["ranks"]:
                s = saved[kind]["entries"].get(key)
                if s is not None and s["start"] < e["end"] and e["start"] < s["end"]:
                    out.add(f"{kind}_rank{saved['rank']:05d}.safetensors")
    return out


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(("fsdp", 4), ("fsdp", 4)), (("zero3", 4), ("zero3", 2)), (("ddp", 2), ("fsdp", 2))],
)
def test_each_rank_reads_only_the_pieces_it_keeps(
    tmp_path: Path, saved: tuple[str, int], loaded: tuple[str, int]
) -> None:
    """Before: every loading rank read and held every saved rank's model and AdamW state (FSDP 4 -> 4:
    4 x 9.7 KB of tensors each, plus the file bytes). Now: exactly its own part."""
    full = run_world(saved[1], _train_and_save, str(tmp_path), saved[0])[0]
    step = tmp_path / "step_00000001"
    sizes = _files(step)
    total = sum(sizes.values())
    got = run_world(loaded[1], _load, str(tmp_path), loaded[0])
    for r, g in enumerate(got):
        assert all(torch.equal(g["full"][k], full[k]) for k in full)
        assert g["tensor_bytes"] == g["held"], (r, g["tensor_bytes"], g["held"])
        files = _overlapping(step, g["mine"])
        assert g["files"] == files
        assert g["bytes_read"] == sum(sizes[f] for f in files) + g["tensor_bytes"]
        assert g["bytes_read"] < 2 * total / loaded[1] + 4096 * len(files), (r, g["bytes_read"], total)


def _tp_model(backend: CommunicationBackend, state: dict[str, torch.Tensor] | None) -> tuple[Any, Any]:
    mesh = Mesh(backend, {"dp": 2, "tp": 2})
    model = TensorParallelModel(build(state, torch.float32), mesh, transformer_plan())
    return model, DDPOptimizer(model, torch.optim.AdamW, lr=0.01)


def _tp_save(backend: CommunicationBackend, root: str) -> None:
    model, opt = _tp_model(backend, initial_state())
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    out = model(x)
    model.cross_entropy(out, x).backward()
    opt.step()
    save_checkpoint(
        root, 1, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {"r": torch.zeros(2)}, {}
    )


def _tp_load(backend: CommunicationBackend, root: str) -> dict[str, Any]:
    model, opt = _tp_model(backend, None)
    ckpt = read_checkpoint(root, verify_all=False)
    model.load_sharded_state_dict(ckpt.model)
    m = ckpt.reads.tensor_bytes
    opt.load_sharded_state_dict(ckpt.optim)
    local = sum(t.numel() * t.element_size() for t in [*model.module.parameters(), *model.module.buffers()])
    state = sum(
        t.numel() * t.element_size()
        for s in opt.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    reads = ckpt.reads
    return {
        "model": m,
        "optim": reads.tensor_bytes - m,
        "local": local,
        "state": state,
        "read": reads.bytes_read,
        "files": set(reads.verified),
    }


def test_tp2_dp2_ranks_read_their_own_boxes(tmp_path: Path) -> None:
    run_world(4, _tp_save, str(tmp_path))
    """Each rank materialises exactly its tp shard and its replicated tensors, model and AdamW state (a
    replicated tensor's state saved by both tp ranks is read once); it verifies the files holding a
    piece of them (streamed, not held: replicated parameters are saved as slices over several ranks),
    never another rank's RNG file."""
    files = _files(tmp_path / "step_00000001")
    for g in run_world(4, _tp_load, str(tmp_path)):
        assert g["model"] == g["local"] and g["optim"] == g["state"], g
        assert g["read"] == sum(files[f] for f in g["files"]) + g["model"] + g["optim"], g
        assert not any(f.startswith("state_") for f in g["files"]) and len(set(g["files"])) == len(g["files"])


# ---------------------------------------------------------------- regions of boxes, in slabs


def _boxes_state(full: torch.Tensor, dim: int, parts: int, splits: int) -> list[ShardedState]:
    """``full`` saved as ``parts`` boxes along ``dim``, each box's flat range cut in ``splits`` shards."""
    from dtlab.core.placement import Box

    states = []
    size = full.shape[dim] // parts
    for p in range(parts):
        offsets = [0] * full.dim()
        offsets[dim] = p * size
        sizes = list(full.shape)
        sizes[dim] = size
        box = Box(tuple(offsets), tuple(sizes))
        flat = full[box.slices()].reshape(-1)
        per = -(-flat.numel() // splits)
        for s in range(splits):
            a, b = min(s * per, flat.numel()), min((s + 1) * per, flat.numel())
            entry = {"key": "w", "shape": list(full.shape), "dtype": "float32", "start": a, "end": b}
            entry["box"] = {"offsets": offsets, "sizes": sizes}
            states.append(
                ShardedState({"w#0": flat[a:b].clone()}, {"entries": {"w#0": entry}, "scalars": {}})
            )
    return states


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_a_box_is_read_from_pieces_of_another_layout_in_slabs(monkeypatch: Any, chunk: int) -> None:
    """tp4 pieces along dim 1 (each split in 3 flat shards) read as tp2 boxes along dim 0 and dim 1,
    and as flat ranges of the full tensor, in slabs of ``chunk`` elements: the values of the slices."""
    from dtlab.core import _shard_reads
    from dtlab.core.placement import Box
    from dtlab.core.shard_index import ShardIndex

    monkeypatch.setattr(_shard_reads, "CHUNK", chunk)
    full = torch.arange(6 * 8 * 4, dtype=torch.float32).reshape(6, 8, 4)
    index = ShardIndex(_boxes_state(full, 1, 4, 3))
    for dim in (0, 1):
        for p in range(2):
            offsets, sizes = [0, 0, 0], list(full.shape)
            sizes[dim] //= 2
            offsets[dim] = p * sizes[dim]
            box = Box(tuple(offsets), tuple(sizes))
            want = full[box.slices()].reshape(-1)
            for a, b in ((0, want.numel()), (3, 50), (17, 18)):
                assert torch.equal(index.read_box("w", box, a, b), want[a:b]), (dim, p, a, b)
    assert torch.equal(index.read("w", 7, 150), full.reshape(-1)[7:150])
    with pytest.raises(CheckpointError, match="cover only"):
        ShardIndex(_boxes_state(full, 1, 4, 3)[1:]).read("w")
