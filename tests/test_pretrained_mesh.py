"""``load_pretrained`` into tensor, pipeline and hybrid models (dtlab's transformer, in-memory ranks):
each rank reads its tensor-parallel slices of its pipeline stages (and its FSDP/ZeRO-3 range of them)
from one safetensors file or a sharded index; the loaded model is bitwise the file and trains like
single-process training from it. A file made by ``dtlab consolidate`` loads the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hybrid_cases import OPTIMIZER_OF
from pretrained_cases import assert_loaded_bitwise, load_into
from safetensors.torch import save_file
from test_tensor_helpers import OPTIMIZERS, STEPS, batch, build, initial_state, train_reference

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import consolidate, save_checkpoint
from dtlab.core import seeded_init
from dtlab.models import HybridShardedModel, ModuleClassPolicy, ZeRO3Model, transformer_plan
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.testing import run_world
from dtlab.trainers.models import Block

CUBE = {"pp": 2, "dp": 2, "tp": 2}
#: (mesh, data-parallel strategy, pipeline arguments): 2-rank ones in one world, 8-rank ones in another
MESHES: dict[str, tuple[dict[str, int], str, dict[str, Any]]] = {
    "tp2": ({"pp": 1, "dp": 1, "tp": 2}, "zero1", {}),
    "pp2/fsdp": ({"pp": 2, "dp": 1, "tp": 1}, "fsdp", {"micro_batches": 2}),
    "dp2xtp2xpp2/fsdp": (CUBE, "fsdp", {"micro_batches": 2}),
    "dp2xtp2xpp2/zero3": (CUBE, "zero3", {"micro_batches": 2}),
}


def _save(root: Path) -> dict[str, torch.Tensor]:
    state = {k: v.contiguous() for k, v in initial_state().items()}
    (root / "one").mkdir()
    save_file(state, str(root / "one" / "model.safetensors"))
    (root / "sharded").mkdir()
    keys = sorted(state)
    weight_map = {k: f"part-{i % 3}.safetensors" for i, k in enumerate(keys)}
    for i in range(3):
        save_file({k: state[k] for k in keys[i::3]}, str(root / "sharded" / f"part-{i}.safetensors"))
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def _on_mesh(backend: CommunicationBackend, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cls, kwargs, dtype = OPTIMIZERS["sgd"]
    for name, (shape, data_parallel, pipeline) in MESHES.items():
        if shape["pp"] * shape["dp"] * shape["tp"] != backend.world_size:
            continue
        for src in ("one", "sharded"):
            key = f"{name}/{src}"
            mesh = Mesh(backend, shape)
            with seeded_init(backend.rank + 1):  # every tensor is loaded: the built values do not matter
                net = build(None, dtype)
            extra: dict[str, Any] = (
                {"wrap_policy": ModuleClassPolicy((Block,))} if data_parallel == "fsdp" else {}
            )
            if data_parallel == "zero3":
                extra["persistence_threshold"] = 0
            plan = transformer_plan() if shape["tp"] > 1 else None
            model = HybridShardedModel(net, mesh, data_parallel, tensor_plan=plan, **pipeline, **extra)
            out[f"{key}/load"] = load_into(model, root / src)
            opt = OPTIMIZER_OF[data_parallel](model, cls, **kwargs)
            x, y = batch()
            dp, coord = mesh.size("dp"), mesh.coordinate("dp")
            x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
            losses = []
            for _ in range(STEPS):
                loss = model.train_step((x, y), model.cross_entropy).detach().double().reshape(1).clone()
                model.dp_backend.all_reduce(loss)
                losses.append(loss.item() / dp)
                opt.step()
                opt.zero_grad()
            out[f"{key}/losses"] = losses
            out[f"{key}/trained"] = model.full_state_dict()
    return out


def test_tensor_pipeline_and_hybrid_models_load_their_slices_bitwise_and_train_like_one_process(
    tmp_path: Path,
) -> None:
    state = _save(tmp_path)
    ref_losses, ref_state = train_reference("sgd")
    worlds = {size: run_world(size, _on_mesh, tmp_path, timeout=300) for size in (2, 8)}
    for name, (shape, _, _) in MESHES.items():
        results = worlds[shape["pp"] * shape["dp"] * shape["tp"]]
        for src in ("one", "sharded"):
            key = f"{name}/{src}"
            for rank, res in enumerate(results):
                where = f"{key} rank {rank}"
                assert_loaded_bitwise(res[f"{key}/load"], state, where)
                losses = res[f"{key}/losses"]
                assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5, (
                    where
                )
                for k, v in ref_state.items():
                    rel = ((res[f"{key}/trained"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
                    assert rel <= 1e-5, (where, k, rel)


def _save_trained(backend: CommunicationBackend, root: Path) -> dict[str, torch.Tensor]:
    with seeded_init(4):
        net = build(initial_state(), torch.float32)
    model = ZeRO3Model(net, backend, persistence_threshold=0)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.5)
    x, y = batch()
    model.train_step(
        (x, y), lambda out, t: torch.nn.functional.cross_entropy(out.reshape(-1, 256), t.reshape(-1))
    )
    opt.step()
    save_checkpoint(root, 1, backend, model.sharded_state_dict(), None, {}, {})
    return model.full_state_dict()


def _load_consolidated(backend: CommunicationBackend, file: Path) -> dict[str, Any]:
    with seeded_init(backend.rank + 1):
        net = build(None, torch.float32)
    model = HybridShardedModel(net, Mesh(backend, {"dp": 2, "tp": 2}), "fsdp", tensor_plan=transformer_plan())
    return load_into(model, file)


def test_a_file_written_by_dtlab_consolidate_loads_slice_by_slice(tmp_path: Path) -> None:
    trained = run_world(2, _save_trained, tmp_path / "ckpt", timeout=120)[0]
    file = consolidate(tmp_path / "ckpt", tmp_path / "full.safetensors")
    for rank, got in enumerate(run_world(4, _load_consolidated, file, timeout=120)):
        assert_loaded_bitwise(got, trained, f"rank {rank}")
