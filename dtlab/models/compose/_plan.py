"""A :class:`~dtlab.core.plan.RunPlan` as the composition's arguments: what
``HybridShardedModel.from_plan`` builds, and the checks a plan needs from the module itself (its
declared tensor plan at ``tp``, its pipeline blocks for ``split_points``), made without communication.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from dtlab.backends.base import CommunicationBackend, check_backend
from dtlab.backends.mesh import Mesh, MeshLike
from dtlab.core.plan import RunPlan
from dtlab.errors import ArgumentTypeError, StrategyError
from dtlab.models.compose._tied import swap_layers
from dtlab.models.pipeline._split import has_blocks, module_blocks
from dtlab.models.pipeline._trace import traced_structure
from dtlab.models.tensor._auto import declared_plan
from dtlab.models.tensor._plan import Plan, PlanDict, resolve_plan, transformer_plan

__all__ = ["apply_tensor_plan", "check_plan", "plan_arguments", "plan_mesh", "tensor_plan_of"]


def tensor_plan_of(plan: RunPlan) -> Plan:
    """The plan's tensor plan as the strategies take it: the one the module declares for ``"auto"``
    (``RunPlan`` checked it is ``"auto"`` or a mapping; each style is checked when it is resolved)."""
    if isinstance(plan.tensor_plan, Mapping):
        return cast(PlanDict, dict(plan.tensor_plan))
    return transformer_plan(plan.sequence_parallel)


def check_plan(module: nn.Module, plan: RunPlan) -> None:
    """What ``plan`` needs of ``module``, checked before any communication: the tensor plan resolves
    at ``tp`` (whole heads, a vocabulary that splits), ``split_points`` name its pipeline blocks
    (or its modules, for a model split at module names)."""
    if plan.tp > 1:
        resolve_plan(module, declared_plan(module, tensor_plan_of(plan)), plan.tp)
    if plan.pp > 1 and plan.split_points is not None:
        if has_blocks(module):
            plan.check_blocks([name for name, _ in module_blocks(module)])
        else:  # module names: they exist, in order, none inside another, none without parameters
            traced_structure(module, plan.split_points, plan.stages)


def apply_tensor_plan(module: nn.Module, tensor_plan: Plan, group: CommunicationBackend) -> nn.Module:
    """``module`` with its planned layers swapped in place for the ones rank ``group.rank`` of
    ``group`` holds, ties kept: the composition's tensor-parallel step without its broadcast of rank
    0's values (no communication). On the meta device: the layout a cost model prices."""
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"apply_tensor_plan takes a torch.nn.Module, got {type(module).__name__}")
    check_backend(group, "apply_tensor_plan(group=...)")
    swap_layers("apply_tensor_plan", module, tensor_plan, group, broadcast=False)
    return module


def plan_mesh(mesh: MeshLike | CommunicationBackend, plan: RunPlan) -> tuple[MeshLike, RunPlan]:
    """The mesh ``plan`` runs on (built over a plain backend) and the plan resolved on its world; a
    given mesh must have the plan's sizes."""
    world = mesh.backend if isinstance(mesh, MeshLike) else mesh
    if not isinstance(world, CommunicationBackend):
        raise TypeError(
            f"HybridShardedModel.from_plan takes a Mesh (or a MeshLike) or a backend, got "
            f"{type(mesh).__name__}"
        )
    resolved = plan.resolve(world.world_size)
    if not isinstance(mesh, MeshLike):
        return Mesh(world, resolved.mesh_shape), resolved
    # the resolved sizes fill the world, so a mesh with them has no other axis above 1
    if {a: mesh.size(a) for a in resolved.mesh_shape} != resolved.mesh_shape:
        raise StrategyError(
            f"HybridShardedModel.from_plan: the mesh {mesh.shape} does not have the plan's sizes "
            f"{resolved.mesh_shape}; build Mesh(backend, plan.resolve(world_size).mesh_shape) or pass the "
            "backend"
        )
    return mesh, resolved


def plan_arguments(plan: RunPlan) -> dict[str, Any]:
    """``HybridShardedModel``'s arguments for ``plan`` (pipeline settings only with a pipeline)."""
    args: dict[str, Any] = {
        "data_parallel": plan.data_parallel,
        "tensor_plan": tensor_plan_of(plan) if plan.tp > 1 else None,
        # without a pipeline the composition refuses it, naming the fix (checkpoint blocks first)
        "activation_checkpointing": plan.activation_checkpointing,
        "tp_batch_check": plan.tp_batch_check,
    }
    if plan.pp > 1:
        args.update(
            schedule=plan.schedule,
            micro_batches=plan.micro_batch_count,
            split_points=plan.split_points,
            stages_per_rank=plan.stages_per_rank,
        )
    return args
