"""Checkpoint files: atomic save, keep-last-N, checksums, SIGKILL while saving, consolidation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_cases import flat_shard
from safetensors.torch import load_file

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import consolidate, full_tensors_from_shards, read_checkpoint, save_checkpoint
from dtlab.errors import CheckpointError
from dtlab.testing import run_world

FULL = {"w": torch.arange(10, dtype=torch.float32).reshape(2, 5), "b": torch.tensor([7.0, 8.0, 9.0])}


def _save(
    backend: CommunicationBackend, root: str, steps: list[int], keep_last: int, tag: str | None = None
) -> str:
    out = ""
    for step in steps:
        shard = flat_shard(FULL, backend.rank, backend.world_size, scale=float(step))
        rng = {"torch_cpu": torch.get_rng_state()}
        meta = {"trainer": {"step": step}}
        out = str(save_checkpoint(root, step, backend, shard, None, rng, meta, keep_last, run_tag=tag))
    return out


def test_save_load_keep_last_and_consolidate(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    paths = run_world(2, _save, str(root), [1, 2, 3], 2)
    assert paths[0] == paths[1] == str(root / "step_00000003")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert (root / "latest").read_text().strip() == "step_00000003"
    ck = read_checkpoint(root)
    assert ck.step == 3 and ck.world_size == 2 and len(ck.model) == 2 and ck.optim is None
    full = full_tensors_from_shards(ck.model)
    for k, v in FULL.items():
        torch.testing.assert_close(full[k], v * 3, rtol=0, atol=0)
    meta = json.loads((root / "step_00000003" / "meta.json").read_text())
    assert set(meta["files"]) == {
        f"{kind}_rank{r:05d}.safetensors" for kind in ("model", "state") for r in range(2)
    }
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in meta["files"].values())
    out = consolidate(root / "step_00000002", tmp_path / "full.safetensors")
    loaded = load_file(str(out))
    for k, v in FULL.items():
        torch.testing.assert_close(loaded[k], v * 2, rtol=0, atol=0)


def test_missing_truncated_and_corrupted_shards_name_the_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_world(2, _save, str(root), [5], 1)
    step = root / "step_00000005"
    shard = step / "model_rank00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model_rank00001\.safetensors is truncated"):
        read_checkpoint(root)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"model_rank00001\.safetensors is corrupted"):
        read_checkpoint(root)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"model_rank00001\.safetensors is missing"):
        read_checkpoint(root)
    (step / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta\.json is corrupted"):
        read_checkpoint(step)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nowhere")


WRITER = """
import sys, torch
torch.set_num_threads(1)
from dtlab.checkpoint import save_checkpoint
from dtlab.core.state import ShardedState
from dtlab.testing import run_world

N = 1 << 20  # 4 MiB per rank per save: a save takes 100+ ms (write, fsync, SHA-256)

def body(backend, root):
    step = 0
    while True:
        step += 1
        r = backend.rank
        entries = {"big": {"shape": [2 * N], "dtype": "float32", "start": r * N, "end": (r + 1) * N}}
        shard = ShardedState({"big": torch.full((N,), float(r + step))}, {"rank": r, "entries": entries})
        if r == 0:
            print("begin", step, flush=True)
        save_checkpoint(
            root, step, backend, shard, None, {"x": torch.zeros(1)}, {"trainer": {}}, 2, run_tag="writer"
        )
        if r == 0:
            print("done", step, flush=True)

run_world(2, body, sys.argv[1], timeout=60)
"""


def _kill_during_second_save(root: Path, delay: float) -> tuple[int, int]:
    """Start a writer, SIGKILL it ``delay`` s after its second save began.

    Returns ``(last_done, last_begun)`` read from everything the writer printed before it died: the
    writer may have moved on past its second save before the signal landed, so the bounds come from
    its whole output, not from the line that triggered the kill.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    # a writer that hangs without printing would block the read below: a watchdog kills it by PID
    watchdog = threading.Timer(120, lambda: proc.poll() is None and os.kill(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        lines: list[str] = []
        for line in proc.stdout:  # bounded: the writer prints every save; deadline + watchdog stop a hang
            lines.append(line)
            if line.split() == ["begin", "2"] or time.monotonic() > deadline:
                break
        assert ["begin", "2"] in [ln.split() for ln in lines], "the writer did not reach its second save"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        lines += proc.stdout.read().splitlines()  # EOF: the writer is dead
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    last = {"begin": 0, "done": 0}
    for line in lines:
        kind, step = line.split()
        last[kind] = max(last[kind], int(step))
    return last["done"], last["begin"]


def test_sigkill_while_saving_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    mid_save = 0
    for trial, delay in enumerate((0.0, 0.01, 0.03, 0.05, 0.08)):
        root = tmp_path / f"ckpt{trial}"
        done, begun = _kill_during_second_save(root, delay)
        ck = read_checkpoint(root)  # every file verified against its SHA-256
        # a finished save is never lost; an unfinished one is either absent or complete
        assert max(done, 1) <= ck.step <= begun, (done, ck.step, begun)
        full = full_tensors_from_shards(ck.model)["big"]
        n = full.numel() // 2
        assert bool((full[:n] == ck.step).all()) and bool((full[n:] == ck.step + 1).all())
        mid_save += begun > done  # the signal landed between a "begin" and its "done"
        assert all((p / "meta.json").is_file() for p in root.iterdir() if p.name.startswith("step_"))
        # another writer's save never removes what the killed writer left in .tmp-* (it may be a run
        # saving right now); a save of the same run (its run_tag) does
        left = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
        run_world(2, _save, str(root), [10_000], 2)
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-")) == left
        assert read_checkpoint(root).step == 10_000
        run_world(2, _save, str(root), [10_001], 2, "writer")
        assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
        assert read_checkpoint(root).step == 10_001
        if mid_save >= 2:
            break
    assert mid_save >= 1, "no SIGKILL landed inside a save; the test did not exercise atomicity"


def test_shards_missing_a_range_are_rejected() -> None:
    shards = [flat_shard(FULL, 0, 2)]  # rank 1's half is absent
    with pytest.raises(CheckpointError, match="cover only"):
        full_tensors_from_shards(shards)


def test_meta_json_with_a_wrong_structure_is_a_checkpoint_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_world(2, _save, str(root), [7], 1)
    meta_path = root / "step_00000007" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for broken, needle in [
        ([1, 2], "holds a JSON list"),
        ({**meta, "format_version": 99}, "format 99, but this dtlab reads format 1"),
        ({k: v for k, v in meta.items() if k != "files"}, "missing ['files']"),
        ({**meta, "ranks": [{"rank": 0}]}, "ranks[0].model=None, expected an object"),
        ({**meta, "files": {}}, "files['model_rank00000.safetensors']=None, expected an object"),
    ]:
        meta_path.write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=r"meta\.json") as info:
            read_checkpoint(root)
        assert needle in str(info.value), (needle, str(info.value))
