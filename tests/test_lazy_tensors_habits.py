"""A loaded checkpoint's lazy tensors behave as the dict of tensors users' own loops expect: a tensor
read whole is kept (an in-place edit stays, a second read reads nothing), ``torch.save``/``pickle`` store
the tensors themselves (loadable with ``torch.load(weights_only=True)``), and a deep copy stays lazy."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards, read_checkpoint, save_checkpoint
from dtlab.testing import run_world
from tests.checkpoint_cases import flat_shard


def _save(backend: CommunicationBackend, root: str) -> None:
    full = {"a": torch.zeros(2), "w": torch.arange(12, dtype=torch.float32)}
    save_checkpoint(root, 1, backend, flat_shard(full, backend.rank, 2), None, {"r": torch.zeros(2)}, {})


def test_a_tensor_read_whole_is_kept_like_a_dicts(tmp_path: Path) -> None:
    """Before: each ``tensors[name]`` read the file again, so ``ckpt.model[0].tensors['w'].mul_(2)`` was
    silently lost (the load took the saved values) and ``t['w'] is t['w']`` was False."""
    run_world(2, _save, str(tmp_path))
    ckpt = read_checkpoint(tmp_path)
    for shard in ckpt.model:
        shard.tensors["w"].mul_(2)  # a user's fix-up before loading
    assert torch.equal(full_tensors_from_shards(ckpt.model)["w"], torch.arange(12, dtype=torch.float32) * 2)
    tensors = ckpt.model[0].tensors
    assert tensors["w"] is tensors["w"]
    read = ckpt.reads.tensor_bytes
    assert [k for k, _ in tensors.items()] == [k for k, _ in tensors.items()] == ["a", "w"]
    assert ckpt.reads.tensor_bytes == read + 4  # "a" read once: iterating again reads nothing
    tensors["a"] = torch.ones(1)
    tensors["new"] = torch.ones(1)
    assert list(tensors) == ["a", "w", "new"]  # as a dict orders them (before: "w" read moved last)


def test_saving_a_loaded_shard_stores_its_tensors(tmp_path: Path) -> None:
    """Before: ``torch.save(ckpt.model[0].tensors, f)`` wrote a 2.6 KB pickle of a reference to the
    checkpoint's file, which ``torch.load`` (``weights_only=True``, torch's default) refused."""
    run_world(2, _save, str(tmp_path))
    ckpt = read_checkpoint(tmp_path)
    buf = io.BytesIO()
    torch.save(ckpt.model[1].tensors, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert isinstance(saved, dict) and torch.equal(saved["w"], torch.arange(6, 12, dtype=torch.float32))
    shards = pickle.loads(pickle.dumps(ckpt.model))
    assert all(isinstance(s.tensors, dict) for s in shards)
    assert torch.equal(full_tensors_from_shards(shards)["w"], torch.arange(12, dtype=torch.float32))
    assert torch.equal(pickle.loads(pickle.dumps(ckpt.rank_states))[1]["r"], torch.zeros(2))


def test_a_deep_copy_stays_lazy_and_apart(tmp_path: Path) -> None:
    run_world(2, _save, str(tmp_path))
    ckpt = read_checkpoint(tmp_path)
    read = ckpt.reads.tensor_bytes
    shards = copy.deepcopy(ckpt.model)
    assert ckpt.reads.tensor_bytes == read  # nothing read by the copy
    shards[0].tensors["w"].add_(100)
    assert torch.equal(full_tensors_from_shards(ckpt.model)["w"], torch.arange(12, dtype=torch.float32))
    assert float(full_tensors_from_shards(shards)["w"][0]) == 100.0
