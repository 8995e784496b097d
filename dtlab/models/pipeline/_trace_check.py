"""The trace of a model split at module names, for one micro-batch shape (docs/your_model.md).

Run alike on every rank before the first step with that shape (so every rank refuses together), on the
micro-batch itself with every parameter a zero broadcast to its recorded shape (buffers this rank holds
keep their values), so values that steer the forward (positions, masks) are the real ones:

1. the whole model's forward with hooks on its blocks: the call order must fit the split; each block's
   output structure (what a stub returns) and the hidden state's slot and spec at each split point;
2. each stage alone, as it will run, with what its stubs return *marked* (and whatever is computed from
   a marked tensor, shape-only functions aside): a marked tensor reaching one of the stage's own blocks
   or its output is refused, naming the block, the argument and the stub it comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from dtlab.errors import StrategyError
from dtlab.models.pipeline._split import Shapes, TensorSpec
from dtlab.models.pipeline._trace import Slot, TracedStage, first_tensor

__all__ = ["Trace", "output_tensor", "trace_split"]

#: functions whose result depends on a tensor's shape, dtype or device only
_SHAPE_ONLY: frozenset[Any] = frozenset(
    [getattr(torch, f"{k}_like") for k in ("empty", "zeros", "ones", "full")]
    + [getattr(torch.Tensor, n) for n in ("size", "dim", "new_empty", "new_zeros", "new_ones", "new_full")]
)


@dataclass
class Trace:
    """What the meta trace gives for one micro-batch shape."""

    specs: list[TensorSpec]  #: each stage's output (the last: the tensor of the model's output)
    outputs: dict[str, Any]  #: block -> its output structure, TensorSpec leaves
    slots: dict[str, Slot]  #: split point -> where the hidden state is among its arguments
    #: the class of the model's output around its logits (a ModelOutput, a dict), None for a tensor
    output_type: type | None

    def as_output(self, logits: torch.Tensor) -> Any:
        """Inference's result as the plain model gives it: the logits in the model's output class (its
        other fields unset, as without labels and a cache), so ``out.logits`` and ``out[0]`` read them."""
        return logits if self.output_type is None else self.output_type(logits=logits)


def output_tensor(out: Any) -> torch.Tensor | None:
    """The tensor of a model's output: itself, or its ``logits`` (a ModelOutput's or a dict's)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


class _Runner(nn.Module):
    """Holds the user's module, so ``functional_call`` swaps its tensors while ``fn`` runs."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.m = module
        self.__dict__["_fn"] = fn

    def forward(self, *args: Any) -> Any:
        return self.__dict__["_fn"](*args)


def _on_zeros(module: nn.Module, shapes: Shapes, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``fn(*args)`` with every parameter of ``module`` a broadcast zero of its shape, and every buffer
    this rank does not hold (on the meta device) likewise."""
    device = args[-1].device
    held = {n: b for n, b in module.named_buffers(remove_duplicate=False) if not b.is_meta}
    made: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    state = {f"m.{n}": held[n] if n in held else _zeros(s, d, device, made) for n, (s, d) in shapes.items()}
    with torch.no_grad():
        return functional_call(_Runner(module, fn), state, args, tie_weights=False, strict=False)


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, made: dict[Any, torch.Tensor]
) -> torch.Tensor:
    """Zeros of ``shape`` expanded from one element, or for a tensor of 3 dims or more from one matrix
    (a stacked experts' weight: ``torch._grouped_mm``, which mixture-of-experts layers call on it,
    refuses a broadcast matrix); each such element or matrix made once per trace (``made``), so the
    trace holds one matrix per shape, not one per layer's weight (Mixtral-8x7B's: 11 GB in bfloat16)."""
    key = (tuple(shape[-2:]) if len(shape) >= 3 else (), dtype)
    if key not in made:
        made[key] = torch.zeros(key[0], dtype=dtype, device=device)
    return made[key].expand(shape)


def _whole(module: nn.Module, stages: Sequence[TracedStage], shapes: Shapes, x: torch.Tensor) -> Trace:
    """Step 1: the whole model with hooks on its blocks."""
    owner = {b: s.index for s in stages for b in s.names}
    points = [s.entry for s in stages[1:] if s.entry is not None]
    blocks = [*owner, *stages[0].replicated]
    outputs: dict[str, Any] = {}
    slots: dict[str, tuple[Slot, TensorSpec]] = {}  # split point -> the hidden state's slot and spec
    latest: list[tuple[int, str]] = [(0, "")]
    kind = type(module).__name__

    def before(name: str, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stage = owner.get(name)
        if stage is not None:
            if stage < latest[-1][0]:
                entry = points[latest[-1][0] - 1]  # the split point that begins the later stage
                raise StrategyError(
                    f"{kind}'s forward calls {name!r} (pipeline stage {stage}) after {latest[-1][1]!r} "
                    f"(stage {latest[-1][0]}): the split points do not follow the forward's order. "
                    "Choose split points in call order, or give the model a pipeline_blocks() method (a "
                    "block belongs to the stage of the last split point registered before it: the model "
                    f"registers {name!r} before split point {entry!r} and calls it after; where it does so "
                    "for every split point, as OPT's final_layer_norm before its layers, only "
                    "pipeline_blocks() can order them)"
                )
            latest.append((stage, name))
        if name in points and name not in slots:
            first = first_tensor(args, kwargs)
            if first is None:
                raise StrategyError(
                    f"split point {name!r} is called without a tensor argument (the hidden state must be "
                    "one of its arguments itself, not inside a list or dict); split at a module taking it "
                    "as a tensor"
                )
            slots[name] = (first[0], TensorSpec.of(first[1]))

    def after(name: str, _m: nn.Module, _a: Any, _k: Any, out: Any) -> None:
        outputs.setdefault(name, tree_map_only(torch.Tensor, TensorSpec.of, out))

    with ExitStack() as hooks:
        for b in blocks:
            m = module.get_submodule(b)
            hooks.callback(m.register_forward_pre_hook(partial(before, b), with_kwargs=True).remove)
            hooks.callback(m.register_forward_hook(partial(after, b), with_kwargs=True).remove)
        out = _on_zeros(module, shapes, module, x)
    missing = [p for p in points if p not in slots]
    if missing:
        raise StrategyError(f"{kind}'s forward never calls split points {missing}; split at modules it calls")
    last = output_tensor(out)
    if last is None:
        raise StrategyError(
            f"{kind} returns a {type(out).__name__}; a pipeline's last stage needs a tensor or an output "
            "with logits (the loss function receives it)"
        )
    _refuse_partial_fields(module, out)
    specs = [slots[p][1] for p in points] + [TensorSpec.of(last)]
    return Trace(specs, outputs, {p: slot for p, (slot, _) in slots.items()}, _output_type(out, last))


#: fields of a model's output beside its logits that a pipeline's last stage gives as the model does
_LAST_STAGE_FIELDS = ("logits", "loss", "past_key_values")


def _refuse_partial_fields(module: nn.Module, out: Any) -> None:
    """A Hugging Face model's output holding tensors beside its logits (``hidden_states``, ``attentions``
    with ``config.output_hidden_states`` / ``output_attentions``, MoE ``router_logits`` and ``aux_loss``)
    is refused: each spans every layer, and the last stage, which gives the loss function and inference
    the model's output, runs only its own (its hidden states and attentions would be those of its layers,
    in the slots of the first ones)."""
    if getattr(module, "config", None) is None or not isinstance(out, Mapping):
        return
    fields = [
        k
        for k, v in out.items()
        if k not in _LAST_STAGE_FIELDS and any(isinstance(t, torch.Tensor) for t in tree_flatten(v)[0])
    ]
    if fields:
        flags = ", ".join(f"hf_model.config.{f} = False" for f in _FLAGS if getattr(module.config, f, False))
        raise StrategyError(
            f"{type(module).__name__}'s output holds {fields} beside its logits: under a pipeline the loss "
            "function and inference get the last stage's output, and these span every layer while the last "
            "stage runs only its own (they would silently hold its layers' alone). Before wrapping, set "
            f"{flags or 'the config flags that ask for them to False'}; or compute them on the plain model "
            "loaded from model.state_dict()"
        )


#: the config flags that add such fields
_FLAGS = ("output_hidden_states", "output_attentions", "output_router_logits")


def _output_type(out: Any, logits: torch.Tensor) -> type | None:
    """``type(out)`` if it is built from its logits alone (``cls(logits=...)``: a ModelOutput, a dict),
    else None (a tensor; an output class that needs more: inference gives the logits tensor)."""
    if out is logits:
        return None
    try:
        type(out)(logits=logits)
    except Exception:  # any class that cannot be built so: the logits alone
        return None
    return type(out)


class _Marks(TorchFunctionMode):
    """Marks every tensor computed from a marked one (with the stub it comes from)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, tuple[torch.Tensor, str]] = {}

    def mark(self, tree: Any, origin: str) -> None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self.held.setdefault(id(t), (t, origin))

    def origin(self, tree: Any) -> str | None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and id(t) in self.held:
                return self.held[id(t)][1]
        return None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _SHAPE_ONLY:
            origin = self.origin((args, kwargs))
            if origin is not None:
                self.mark(out, origin)
                if args and (getattr(func, "__name__", "").endswith("_") or func is torch.Tensor.__setitem__):
                    self.mark(args[0], origin)  # written in place
        return out


def _check_stage(
    stage: TracedStage, module: nn.Module, shapes: Shapes, x: torch.Tensor, inputs: torch.Tensor
) -> None:
    """Step 2: one stage as it will run, with what its stubs return marked."""
    marks = _Marks()

    def guard(name: str, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for arg, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            origin = marks.origin(value)
            if origin is not None:
                raise StrategyError(
                    f"pipeline stage {stage.index}: {name!r} gets {arg!r} computed from {origin!r}, a "
                    "block of an earlier stage on another rank; only the hidden state at the split point "
                    "crosses stages. Split elsewhere, or give the model a pipeline_blocks() method"
                )

    def run(xx: torch.Tensor, ii: torch.Tensor) -> None:
        with marks:
            out = stage(xx, ii)
        origin = marks.origin(out)
        if origin is not None:
            raise StrategyError(
                f"pipeline stage {stage.index}'s output is computed from {origin!r}, a block of an earlier "
                "stage; split elsewhere, or give the model a pipeline_blocks() method"
            )

    with ExitStack() as hooks:
        for stub in stage.stubs():
            name = str(stub.block_name)
            hooks.callback(stub.register_forward_hook(lambda _m, _a, out, n=name: marks.mark(out, n)).remove)
        for name, block in zip(stage.names, stage.blocks, strict=False):
            hooks.callback(block.register_forward_pre_hook(partial(guard, name), with_kwargs=True).remove)
        _on_zeros(module, shapes, run, x, inputs)


def trace_split(
    module: nn.Module, stages: Sequence[TracedStage], shapes: Shapes, sample: torch.Tensor
) -> Trace:
    """The trace for micro-batches like ``sample`` (a micro-batch of the model's input), every check
    done."""
    inputs = sample.detach()
    try:
        trace = _whole(module, stages, shapes, inputs)
    except StrategyError:
        raise
    except Exception as exc:
        raise StrategyError(
            f"{type(module).__name__}'s forward could not be traced with zero weights on input "
            f"{tuple(sample.shape)} {sample.dtype} ({type(exc).__name__}: {exc}); a pipeline split at "
            "module names calls the model with that one tensor alone, so it needs a forward that runs on "
            "it (an encoder-decoder that needs decoder inputs does not: give it a pipeline_blocks() "
            "method) and whose shapes do not depend on the weights' values"
        ) from exc
    for stage in stages:
        stage.prepare(trace.outputs, trace.slots)
        prev = trace.specs[stage.index - 1]  # the hidden state it receives (stage 0: the input itself)
        x = torch.zeros(prev.shape, dtype=prev.dtype, device=inputs.device) if stage.index else inputs
        _check_stage(stage, module, shapes, x, inputs)
    return trace
