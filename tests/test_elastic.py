"""ElasticOptimizer on the in-memory engine: one of 4 ranks killed mid-run and added back later under
DDP, ZeRO-2 and FSDP (the loss trajectory from each commit equals an uninterrupted run at the new
size), the ring copy (any single loss is survived, two neighbours lost is a clear error, exact bytes),
the run_elastic driver's checks, and MPI refused up front."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic_cases import elastic_fsdp, full_state
from refusals import refusal_messages
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.errors import CheckpointError, ConfigError, RankFailedError
from dtlab.optimizers import DDPOptimizer
from dtlab.optimizers.elastic import ElasticOptimizer, MemoryCommitStore, StaticMember
from dtlab.testing import TINY_LM, run_world, spawn_world
from dtlab.testing.elastic import InMemoryMember, Join, Kill, run_elastic
from dtlab.trainers import StopRequest, Task, Trainer, build_task

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "data.global_batch_size=12",  # splits over 4 and 3 ranks: the global batch is kept
    "optimizer.warmup_steps=1",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.log_every=1",
    "train.steps=8",
]


def _elastic_rank(
    backend: CommunicationBackend, member: InMemoryMember, config: TrainConfig, task: Task | None = None
) -> Any:
    return Trainer(config, backend, task=task, member=member).fit()


def _segment(
    backend: CommunicationBackend, config: TrainConfig, task: Task, upto: int
) -> list[tuple[int, float]]:
    """An uninterrupted run at this world size from the checkpoint the config resumes, up to ``upto``."""
    trainer = Trainer(config, backend, task=task)
    losses = []
    while trainer.step < upto:
        applied, loss, _ = trainer.train_step()
        trainer.step += 1
        assert applied and loss is not None
        losses.append((trainer.step, loss))
    if config.checkpoint.dir is not None:
        trainer.save_checkpoint()
    return losses


def _trajectory(run_dir: Path) -> tuple[dict[int, float], list[int], list[dict[str, Any]]]:
    """Last loss logged per step, every step logged in order, and the restore records."""
    losses: dict[int, float] = {}
    order: list[int] = []
    restores = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "elastic" in rec:
            restores.append(rec["elastic"])
        elif "loss" in rec:
            losses[rec["step"]] = rec["loss"]
            order.append(rec["step"])
    return losses, order, restores


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_kill_one_of_four_then_add_it_back(strategy: str, tmp_path: Path) -> None:
    base = [*TINY, f"strategy.model={strategy}"]
    cfg = load_config(overrides=[*base, f"logging.run_dir={tmp_path / 'run'}", "elastic.commit_every=2"])
    task = build_task(cfg)  # one task: its lock makes every rank build the same initial model
    run = run_elastic(_elastic_rank, 4, cfg, task, schedule=[Kill(step=3, rank=1), Join(step=6)], timeout=60)

    assert [w["world_size"] for w in run.worlds] == [4, 3, 4]
    # the kill after step 3 redoes step 3 from the commit of step 2; the join commits first: none redone
    assert [w["first_step"] for w in run.worlds] == [1, 3, 7]
    assert len(run.detections) == 3  # every survivor got the world's error naming the dead rank
    assert all("because rank 1 failed: RankKilledError" in d["error"] for d in run.detections)
    assert len(run.results) == 4 and all(r.final_step == 8 for r in run.results)
    losses, order, restores = _trajectory(tmp_path / "run")
    assert order == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert [(r["step"], r["from_world_size"], r["world_size"]) for r in restores] == [(2, 4, 3), (6, 3, 4)]

    # the reference: uninterrupted runs at each size from the same step, through disk checkpoints
    ck = tmp_path / "ck"
    ref = run_world(4, _segment, load_config(overrides=[*base, f"checkpoint.dir={ck}"]), task, 2)[0]
    resume = [f"checkpoint.dir={ck}", "checkpoint.resume=true"]
    seg = load_config(overrides=[*base, "backend.world_size=3", *resume])
    ref += run_world(3, _segment, seg, task, 6)[0]
    seg = load_config(overrides=[*base, *resume])
    ref += run_world(4, _segment, seg, task, 8)[0]
    assert [s for s, _ in ref] == list(range(1, 9))
    for step, loss in ref:  # nothing committed was lost: bitwise the same trajectory
        assert losses[step] == loss, (strategy, step, losses[step], loss)


# ---------------------------------------------------------------------------------------- ring copy
def _train_and_commit(
    backend: CommunicationBackend, stores: list[MemoryCommitStore], copy_to: int = 1
) -> Any:
    opt = elastic_fsdp(backend, StaticMember(stores[backend.rank]), copy_to)
    g = torch.Generator().manual_seed(backend.rank)
    for step in range(1, 3):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(opt.model(x), y).backward()
        opt.step()
        sent = backend.stats["send"].bytes_sent
        committed = opt.end_step(step, state={"step": step})
        ring = backend.stats["send"].bytes_sent - sent
    assert committed
    return full_state(opt), opt.commit_bytes, ring, stores[backend.rank].nbytes()


def _restore(backend: CommunicationBackend, stores: list[MemoryCommitStore]) -> Any:
    opt = elastic_fsdp(backend, StaticMember(stores[backend.rank]))
    commit = opt.restore()
    assert commit is not None
    return full_state(opt), commit.key.step, commit.state, opt.recovery


def _copy(store: MemoryCommitStore) -> MemoryCommitStore:
    out = MemoryCommitStore()
    for key in store.keys():
        out.put(store.get(key))
    return out


def test_ring_copy_survives_any_single_loss_and_names_what_two_neighbours_lose() -> None:
    stores = [MemoryCommitStore() for _ in range(4)]
    out = run_world(4, _train_and_commit, stores)
    committed = out[0][0]
    sizes = [o[1] for o in out]
    prev = sizes[-1:] + sizes[:-1]
    for own, ring, held, nxt in zip(sizes, [o[2] for o in out], [o[3] for o in out], prev, strict=True):
        assert ring == 8 + own  # the commit's size, then its bytes, to rank + 1: exactly
        assert held == own + nxt  # its own commit and its ring neighbour's (rank - 1) copy
    for lost in ([1], [3], [0, 2]):
        survivors = [_copy(s) for r, s in enumerate(stores) if r not in lost]
        for state, step, extra, recovery in run_world(len(survivors), _restore, survivors):
            assert step == 2 and extra == {"step": 2}
            assert recovery["from_world_size"] == 4 and recovery["world_size"] == len(survivors)
            assert state.keys() == committed.keys()
            for k, v in committed.items():  # parameters and AdamW moments, bitwise
                assert torch.equal(state[k], v), (lost, k)
        # the restore re-committed under the new world and dropped the commit it restored
        assert {k.world_size for s in survivors for k in s.keys()} == {len(survivors)}
    with pytest.raises(RankFailedError) as info:
        run_world(2, _restore, [stores[0], stores[3]])  # ranks 1 and 2 are ring neighbours
    cause = info.value.__cause__
    assert isinstance(cause, CheckpointError)
    assert "no surviving copy of rank(s) [1]'s shards" in str(cause)
    # two ranks per node: copy_to=2 puts each copy on the other node, so a whole node may go
    stores = [MemoryCommitStore() for _ in range(4)]
    committed = run_world(4, _train_and_commit, stores, 2)[0][0]
    for state, *_ in run_world(2, _restore, [_copy(stores[2]), _copy(stores[3])]):
        assert all(torch.equal(state[k], v) for k, v in committed.items())
    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0, 2\]'s shards"):
        run_world(2, _restore, [stores[1], stores[3]])  # 0's copy was on rank 2, 2's on rank 0


# ---------------------------------------------------------------------------------------- checks
def _boom(backend: CommunicationBackend, member: InMemoryMember) -> None:
    if member.id == 2:
        raise ValueError("a real bug")
    backend.barrier()


def test_run_elastic_reports_real_failures_and_checks_its_schedule() -> None:
    with pytest.raises(RankFailedError, match="member 2 failed: ValueError: a real bug") as info:
        run_elastic(_boom, 3, timeout=20)
    assert info.value.rank == 2
    with pytest.raises(ValueError, match=r"kill a rank in \[0, 3\)"):
        run_elastic(_boom, 4, schedule=[Kill(step=1, rank=0), Kill(step=2, rank=3)])
    with pytest.raises(ValueError, match="would leave no rank alive"):
        run_elastic(_boom, 1, schedule=[Kill(step=1, rank=0)])


def _refusals(backend: CommunicationBackend) -> list[str]:
    from dtlab.models import DDPModel

    inner = DDPOptimizer(DDPModel(nn.Linear(2, 2), backend), torch.optim.SGD, lr=0.1)
    return refusal_messages(partial(ElasticOptimizer, inner, commit_every=every) for every in (0, 1.5, 2))


def test_mpi_is_refused_up_front_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="ULFM"):
        load_config(overrides=["backend.name=mpi", "elastic.commit_every=5"])
    on_mpi = spawn_world(1, _refusals, backend="mpi", timeout=60)[0]
    assert len(on_mpi) == 3 and "commit_every must be an integer >= 1" in on_mpi[0]
    assert "ULFM" in on_mpi[2] and "MPICH's default build" in on_mpi[2]
    assert run_world(1, _refusals) == [on_mpi[:2]]  # in memory the same wrapper is accepted


def _trainer(backend: CommunicationBackend, config: TrainConfig) -> Trainer:
    return Trainer(config, backend)


def test_trainer_elastic_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"elastic\.commit_every"):
        load_config(overrides=["elastic.commit_every=-1"])
    cfg = load_config(overrides=[*TINY, "logging.run_dir=null"])
    with pytest.raises(RankFailedError) as info:
        run_elastic(_elastic_rank, 1, cfg, timeout=20)  # a member, but commits are off
    assert "elastic.commit_every is 0" in str(info.value.__cause__)
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    for var, value in torchrun.items():
        monkeypatch.setenv(var, value)
    on = load_config(overrides=[*TINY, "logging.run_dir=null", "elastic.commit_every=2"])
    with pytest.raises(RankFailedError) as info:
        run_world(1, _trainer, on)  # under torchrun the commits must go to disk
    assert "Set elastic.dir to a node-local directory" in str(info.value.__cause__)


def _stopped_then_resumed(
    backend: CommunicationBackend, config: TrainConfig, task: Task, stop: StopRequest | None
) -> tuple[int, int | None, list[tuple[int, float]]]:
    trainer = Trainer(config, backend, task=task, stop=stop)
    start = trainer.start_step
    result = trainer.fit()
    return start, result.final_step, result.losses


def test_a_stop_commits_to_elastic_dir_and_a_new_process_resumes_there(tmp_path: Path) -> None:
    """torchrun's SIGTERM before a restart (a node joins): the agreed stop commits to the node-local
    directory, so the restarted workers, here at another world size, redo nothing."""
    over = [*TINY, "logging.run_dir=null", "elastic.commit_every=4", f"elastic.dir={tmp_path / 'node'}"]
    cfg = load_config(overrides=over)
    task = build_task(cfg)
    stop = StopRequest()
    stop.request("SIGTERM")  # already signalled: every rank stops after step 1
    first = run_world(2, _stopped_then_resumed, cfg, task, stop)
    assert [r[1] for r in first] == [1, 1]
    files = sorted(p.name for p in (tmp_path / "node").iterdir())
    assert files == [f"commit-s00000001-g0000-r0000{r}of00002.safetensors" for r in range(2)]
    second = run_world(4, _stopped_then_resumed, load_config(overrides=over), task, None)
    assert [r[0] for r in second] == [1] * 4 and [r[1] for r in second] == [8] * 4
    reference = run_world(
        2, _stopped_then_resumed, load_config(overrides=[*TINY, "logging.run_dir=null"]), task, None
    )
    for (step, loss), (ref_step, ref) in zip(second[0][2], reference[0][2][1:], strict=True):
        assert step == ref_step and loss == pytest.approx(ref, rel=1e-5)
