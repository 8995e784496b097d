"""DeepSpeed's side of ``dtlab.benchmarks.vs_deepspeed``: its engine at ZeRO stage 1, 2 or 3 on the
process group dtlab's Gloo backend already initialized, the bytes its collectives send (counted with
dtlab's formulas by wrapping the ``torch.distributed`` calls it makes) and the tensors it holds per
rank (exact bytes, found by walking its engine and optimizer).

DeepSpeed is imported by name (``importlib``) only inside these functions: it is an optional,
untyped third-party package, never needed by dtlab itself.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DS_INSTALL",
    "SentCounter",
    "ds_engine",
    "ds_full_params",
    "ds_held_bytes",
    "ds_version",
    "ds_watch_gathered",
]

#: the command that makes DeepSpeed importable next to dtlab without touching the environment's torch
DS_INSTALL = (
    "pip install --target /tmp/ds-pkgs --no-deps deepspeed hjson ninja py-cpuinfo msgpack psutil einops "
    "&& export PYTHONPATH=/tmp/ds-pkgs:$PYTHONPATH"
)


def _deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    return importlib.import_module("deepspeed")


def ds_version() -> str | None:
    """DeepSpeed's version, or None when it cannot be imported here."""
    try:
        return str(_deepspeed().__version__)
    except Exception:  # any import failure means: not usable here
        return None


def ds_engine(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    micro_batch: int,
    bucket_numel: int,
    zero_options: dict[str, Any],
) -> Any:
    """DeepSpeed's engine for ``module`` at ZeRO ``stage`` with a client torch optimizer (no C++ op is
    built), fp32 throughout, no gradient clipping, buckets of ``bucket_numel`` elements, any other
    ``zero_optimization`` settings in ``zero_options``; on the default process group, which the caller
    initialized (``dist_init_required=False``)."""
    ds = _deepspeed()
    world = dist.get_world_size()
    config = {
        "train_batch_size": micro_batch * world,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,  # torch.optim.SGD is not on DeepSpeed's tested list
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket_numel,
            "allgather_bucket_size": bucket_numel,
            "stage3_prefetch_bucket_size": bucket_numel,
            **zero_options,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = ds.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine


def ds_full_params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """Copies of the whole parameters (collective at stage 3: every rank calls)."""
    names = [n for n, _ in engine.module.named_parameters()]
    params = list(engine.module.parameters())
    if stage == 3:
        with _deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().clone() for n, p in zip(names, params, strict=True)}
    return {n: p.detach().clone() for n, p in zip(names, params, strict=True)}


# ---------------------------------------------------------------------------- bytes sent
def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return 0


class SentCounter:
    """Counts the bytes this rank sends in the ``torch.distributed`` collectives called while armed,
    with the formulas of dtlab's ``CommStats`` (all-reduce ``2(P-1)/P n``, reduce-scatter and
    all-gather ``(P-1)`` times the shard, broadcast and reduce one buffer for all but one rank)."""

    NAMES = (
        "all_reduce",
        "reduce_scatter_tensor",
        "reduce_scatter",
        "_reduce_scatter_base",
        "all_gather_into_tensor",
        "all_gather",
        "_all_gather_base",
        "broadcast",
        "reduce",
        "all_to_all_single",
    )

    def __init__(self) -> None:
        self.armed = False
        self.sent = 0
        self.calls: dict[str, tuple[int, int]] = {}  # kind -> (calls, bytes sent)
        self._saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                sent = self._sent(name, args, kwargs)
                self.sent += sent
                calls, total = self.calls.get(name, (0, 0))
                self.calls[name] = (calls + 1, total + sent)
            return fn(*args, **kwargs)

        return counted

    @staticmethod
    def _sent(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        group = kwargs.get("group")
        p, me = dist.get_world_size(group), dist.get_rank()
        first = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
        if p == 1:
            return 0
        if name == "all_reduce":
            return 2 * (p - 1) * _nbytes(first) // p
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter"):
            return (p - 1) * _nbytes(first)  # the output: this rank's shard
        if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather"):
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("tensor"))
            return (p - 1) * _nbytes(inp)
        if name == "reduce":  # a chain ending at dst: every rank but dst sends the buffer once
            dst = args[1] if len(args) > 1 else kwargs.get("dst")
            return 0 if me == dst else _nbytes(first)
        if name == "broadcast":  # a chain from src: every rank but the one before src sends it once
            src = args[1] if len(args) > 1 else kwargs.get("src", 0)
            return 0 if me == (int(src) - 1) % p else _nbytes(first)
        out = args[0] if args else kwargs.get("output")
        return (p - 1) * _nbytes(out) // p  # all_to_all_single: all but this rank's own part


# ---------------------------------------------------------------------------- memory
def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        ds_tensor = getattr(obj, "ds_tensor", None)  # a stage-3 parameter's own partition
        if isinstance(ds_tensor, torch.Tensor):
            yield ds_tensor
        if obj.grad is not None:
            yield obj.grad
    elif depth < 4 and isinstance(obj, list | tuple | set):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _claim(seen: set[int], ts: Iterator[torch.Tensor]) -> int:
    """Bytes of the storages behind ``ts`` not counted yet (a view counts its whole storage once)."""
    total = 0
    for t in ts:
        if t.device.type == "meta":
            continue  # no memory behind it
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def ds_held_bytes(engine: Any) -> dict[str, Any]:
    """The bytes of every tensor storage this rank's DeepSpeed engine holds, each storage counted once,
    in this order: the module's parameters (and a stage-3 parameter's partition ``ds_tensor``) and
    their ``.grad``; the wrapped torch optimizer's state (``exp_avg``, ``exp_avg_sq``, ``step``,
    ``momentum_buffer``); then every tensor reachable (lists, dicts, 4 levels deep; a tensor's
    ``.grad`` too) from an attribute of DeepSpeed's ZeRO optimizer, by attribute name: those naming
    ``fp32`` are its fp32 master partitions, those naming ``grad`` or ``ipg`` gradient partitions and
    reduction buckets (added to ``gradients``), the rest ``other``. Returns the totals by kind and
    the per-attribute bytes."""
    seen: set[int] = set()
    params = list(engine.module.parameters())
    out: dict[str, Any] = {"parameters": _claim(seen, (t for p in params for t in _own(p)))}
    out["gradients"] = _claim(seen, (p.grad for p in params if p.grad is not None))
    zero = engine.optimizer
    out["optimizer_state"] = _claim(seen, _tensors([dict(s) for s in zero.optimizer.state.values()]))
    out["master"] = out["other"] = 0
    attrs: dict[str, int] = {}
    for name, value in sorted(vars(zero).items()):
        b = _claim(seen, _tensors(value))
        if b:
            attrs[name] = b
            low = name.lower()
            kind = "master" if "fp32" in low else "gradients" if "grad" in low or "ipg" in low else "other"
            out[kind] += b
    out["attributes"] = attrs
    return out


def ds_watch_gathered(engine: Any) -> tuple[dict[str, int], list[Any]]:
    """Stage 3: at every module's forward and backward pre-hook (after DeepSpeed's own, which fetch the
    parameters), the bytes of the whole parameters available then (not counting those kept whole
    below ``stage3_param_persistence_threshold``, which ``parameters`` counts); the peak goes to
    ``peak["bytes"]``. Returns that dict and the hook handles (remove them after the probe)."""
    peak = {"bytes": 0}
    modules = list(engine.module.modules())

    def probe(*_: Any) -> None:
        total = sum(
            p.numel() * p.element_size()
            for m in modules
            for p in m.parameters(recurse=False)
            if p.numel() > 0 and not getattr(p, "ds_persist", False)
        )
        peak["bytes"] = max(peak["bytes"], total)

    handles = [m.register_forward_pre_hook(probe) for m in modules]
    handles += [m.register_full_backward_pre_hook(probe) for m in modules]
    return peak, handles


def _own(p: torch.Tensor) -> Iterator[torch.Tensor]:
    yield p
    ds_tensor = getattr(p, "ds_tensor", None)
    if isinstance(ds_tensor, torch.Tensor):
        yield ds_tensor
