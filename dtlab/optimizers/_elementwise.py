"""Whether a torch optimizer may step pieces of parameters: the check behind every optimizer strategy
whose local optimizer steps flat shards (ZeRO-1/2/3, FSDP) or tensor-parallel slices.

Stepping a piece gives the update of the whole parameter only when each element's update depends on
that element alone (SGD, Adam, AdamW, RMSprop, Adagrad, Rprop, ...). torch's Adafactor factors its
second moment over a matrix's rows and columns and scales by the parameter's RMS, Muon orthogonalizes
the whole matrix, LAMB/LARS scale by per-parameter norms, and an optimizer of your own may scale by
a norm over its whole param group (a global gradient norm inside ``step``): on a piece, or with only
this rank's pieces in the group, each would step silently differently, or (Muon on a 1-D shard) stop
with its own error. The check runs the user's class, with each group's options, on a small matrix
whole and as pieces, each piece in an optimizer of its own (as each rank holds its own pieces), for
two steps on the same gradients, and refuses the class when the results differ.

A pipeline rank's optimizer steps whole parameters, but only those of its stages: an optimizer whose
update of a parameter depends on the other parameters of its group (that group norm) would see this
rank's part of the group. There the check steps two matrices in one optimizer and each in an
optimizer of its own, and refuses the class when they differ.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.core.placement import Shard
from dtlab.core.torch_private import unhooked_step
from dtlab.errors import StrategyError
from dtlab.models.base import OptimizerTarget
from dtlab.optimizers._groups import OptimizerSpec, constructor_defaults

__all__ = ["check_elementwise", "check_pieces", "split_dims", "steps_slices"]

_ROWS, _COLS, _STEPS, _LR = 4, 6, 2, 1e-2
#: how far (relative to how far the steps moved the matrix) the pieces may end from the whole: the
#: rounding of an element-wise update in float32 (an optimizer that does not take float64, or torch's
#: compile path with float32 step scalars, which torch's optimizers take while any thread of the process
#: traces a compiled model: an in-memory rank compiling, 7.6e-6 for AdamW in float64). An update that
#: depends on other elements ends 1e-2 to 1e-1 away (a norm over a piece is not the whole's)
_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}


def _steps(
    spec: OptimizerSpec, options: dict[str, Any], params: list[torch.Tensor], grads: list[list[torch.Tensor]]
) -> None:
    """``_STEPS`` steps of ``spec.cls`` with one group's options (at a learning rate that moves the
    matrix: a schedule may start at 0) over ``params``, with the gradients ``grads[step]``."""
    opts = {k: v for k, v in options.items() if k != "params"}
    if "lr" in opts:
        opts["lr"] = _LR
    defaults = {**constructor_defaults(spec), **({"lr": _LR} if "lr" in spec.defaults else {})}
    opt = spec.cls([{**opts, "params": params}], **defaults)
    step = unhooked_step(opt)  # torch's global step hooks see no probe
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        step()


def _split(t: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
    """Two flat pieces cutting a row when ``dim`` is None, else two blocks along ``dim`` (tensor
    parallelism: rows for column-parallel weights and embeddings, columns for row-parallel weights)."""
    if dim is None:
        return [t.reshape(-1)[: _COLS + 1], t.reshape(-1)[_COLS + 1 :]]
    return list(t.chunk(2, dim=dim))


_CUT = {None: "in two flat pieces", 0: "in two blocks of rows", 1: "in two blocks of columns"}


def _problem(
    spec: OptimizerSpec, options: dict[str, Any], device: torch.device, dim: int | None
) -> str | None:
    """Why stepping pieces differs from stepping the whole matrix, or None when it does not (or when
    the class cannot step the probe matrix whole either: nothing to compare)."""
    for dtype, tolerance in _TOLERANCE.items():
        gen = torch.Generator().manual_seed(0)
        start = torch.randn(_ROWS, _COLS, generator=gen, dtype=torch.float64)
        grads = [torch.randn(_ROWS, _COLS, generator=gen, dtype=torch.float64) for _ in range(_STEPS)]
        start, grads = start.to(device, dtype), [g.to(device, dtype) for g in grads]
        whole = start.clone().requires_grad_(True)
        try:
            _steps(spec, options, [whole], [[g] for g in grads])
        except Exception:  # e.g. a fused kernel without float64: try float32
            continue
        pieces = [p.clone().requires_grad_(True) for p in _split(start, dim)]
        try:  # each piece in an optimizer of its own: each rank steps its pieces, not the others'
            for k, piece in enumerate(pieces):
                _steps(spec, options, [piece], [[_split(g, dim)[k]] for g in grads])
        except Exception as exc:  # the class refuses pieces (Muon: 2-D parameters only)
            return f"stepping pieces failed: {type(exc).__name__}: {exc}"
        if dim is None:
            joined = torch.cat([p.detach().reshape(-1) for p in pieces]).reshape(_ROWS, _COLS)
        else:
            joined = torch.cat([p.detach() for p in pieces], dim=dim)
        moved = float((whole.detach() - start).abs().max())
        off = float((whole.detach() - joined).abs().max())
        if moved > 0 and off > tolerance * moved:
            return (
                "its update of an element depends on other elements of the parameter or of its param "
                f"group (on a {_ROWS}x{_COLS} matrix stepped {_CUT[dim]}, each in an optimizer of its own "
                f"as on two ranks, {_STEPS} steps moved it {moved:.3g} and the pieces ended {off:.3g} away "
                "from the whole)"
            )
        return None
    return None


def check_elementwise(
    who: str,
    spec: OptimizerSpec,
    groups: list[dict[str, Any]],
    device: torch.device,
    flat: bool,
    dims: frozenset[int] = frozenset({0}),
) -> None:
    """Refuse ``spec``'s optimizer class, naming it and the fix, when stepping pieces of a parameter
    (flat shards when ``flat``, else tensor-parallel blocks split along each of ``dims``: a dim
    above 1 is probed as 1, across the matrix's rows) differs from stepping it whole, with the
    options of any of ``groups``. Deterministic: every rank decides the same."""
    what = (
        "flat shards of every parameter (ZeRO-1/2/3, FSDP)"
        if flat
        else "tensor-parallel pieces of parameters"
    )
    cuts: list[int | None] = [None] if flat else [*sorted({min(d, 1) for d in dims})]
    for gi, options in enumerate(groups):
        problem = next((p for cut in cuts if (p := _problem(spec, options, device, cut)) is not None), None)
        if problem is not None:
            raise StrategyError(
                f"{who}: {spec.cls.__name__} (param group {gi}) cannot step {what}: {problem}. Only "
                "element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, Rprop, NAdam, RAdam, ...) "
                "give the same step on a piece as on the whole parameter. Use DDPModel with DDPOptimizer "
                "(whole parameters on every rank) for this optimizer, or an element-wise one under this "
                "strategy"
            )


def split_dims(model: OptimizerTarget) -> frozenset[int]:
    """The dims along which some trainable parameter of ``model`` is this rank's slice of a tensor
    split over an axis of size > 1 (tensor parallelism: an optimizer stepping the parameters steps
    pieces), empty when none is."""
    dims = set()
    for name, _ in model.trainable_parameters():
        placement, _, size = model.placed(name)
        if isinstance(placement, Shard) and size > 1:
            dims.add(placement.dim)
    return frozenset(dims)


def steps_slices(model: OptimizerTarget) -> bool:
    """True when some trainable parameter of ``model`` is this rank's slice of a tensor split over an
    axis of size > 1 (tensor parallelism): an optimizer stepping the parameters steps pieces."""
    return bool(split_dims(model))


def _coupled(spec: OptimizerSpec, options: dict[str, Any], device: torch.device) -> str | None:
    """Why stepping two parameters in one optimizer differs from stepping each in its own, or None."""
    shapes = [(_ROWS, _COLS), (_COLS, _ROWS - 1)]
    for dtype, tolerance in _TOLERANCE.items():
        gen = torch.Generator().manual_seed(0)
        start = [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]
        grads = [[torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes]]
        grads.append([torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype) for s in shapes])
        together = [t.clone().requires_grad_(True) for t in start]
        apart = [t.clone().requires_grad_(True) for t in start]
        try:
            _steps(spec, options, together, grads)
            for k, p in enumerate(apart):
                _steps(spec, options, [p], [[g[k]] for g in grads])
        except Exception:  # e.g. a fused kernel without float64: try float32
            continue
        moved = max(float((t.detach() - s).abs().max()) for t, s in zip(together, start, strict=True))
        off = max(float((t.detach() - a.detach()).abs().max()) for t, a in zip(together, apart, strict=True))
        if moved > 0 and off > tolerance * moved:
            return (
                "its update of a parameter depends on the other parameters of its param group (two "
                f"matrices stepped in one optimizer and each in its own, {_STEPS} steps moved them "
                f"{moved:.3g} and they ended {off:.3g} apart)"
            )
        return None
    return None


def check_pieces(
    who: str, spec: OptimizerSpec, groups: list[dict[str, Any]], model: OptimizerTarget, kind: str | None
) -> None:
    """Refuse ``spec``'s class where this rank's optimizer would step it otherwise than one process:
    on pieces of parameters (``kind``: ``"flat"`` shards or tensor-parallel ``"slices"``), or, on a
    pipeline rank (whole parameters of its stages only), when it couples the parameters of a group."""
    device = model.dp_backend.device
    if kind is not None:
        check_elementwise(who, spec, groups, device, flat=kind == "flat", dims=split_dims(model))
        return
    pp = getattr(model, "pp_group", None)
    if pp is None or pp.world_size == 1:
        return
    for gi, options in enumerate(groups):
        problem = _coupled(spec, options, device)
        if problem is not None:
            raise StrategyError(
                f"{who}: {spec.cls.__name__} (param group {gi}) cannot step a pipeline rank's parameters: "
                f"{problem}, and each pipeline rank's optimizer holds only its stages' parameters. Use an "
                "optimizer whose update of a parameter depends on that parameter alone (SGD, AdamW, "
                "Adafactor, Muon, ...), or train this model without a pipeline (DDPModel with DDPOptimizer)"
            )
