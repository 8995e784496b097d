"""Your own model, data and loss: from the config (``model.factory``, ``data.factory``, ``model.loss``,
each ``package.module:function`` called with no arguments) or as Python objects given to the Trainer.

Everything is checked before any rank starts, each problem one :class:`~dtlab.errors.ConfigError`
naming the field: a reference that does not import, a factory that returns the wrong kind of object,
data that is not a map-style ``Dataset`` of ``(input, target)`` pairs, and a loss that does not fit
the model's output on three training samples (one forward on the CPU, no backward), and every class
target of a small dataset inside the model's output range (``trainers/labels.py``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset

from dtlab.config import TrainConfig
from dtlab.core import seeded_init
from dtlab.data import fetch
from dtlab.errors import ConfigError
from dtlab.parallel_config import check_tensor_plan_fits
from dtlab.trainers.embedded import Task, builtin_data, builtin_model, cross_entropy_loss, logits_of
from dtlab.trainers.labels import refuse_unshifted_labels, scan_labels, shifts_labels_inside
from dtlab.untrusted import summary

__all__ = ["LOSSES", "check_fit", "resolve", "task_from_config", "task_from_objects"]

Loss = Callable[[Any, Any], torch.Tensor]


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in float32; the target must have the output's number of elements (a ``(B,)``
    target for a ``(B, 1)`` output is fine), never broadcast."""
    if output.numel() != target.numel():
        raise ValueError(
            f"mse needs one target value per output value: output {tuple(output.shape)}, target "
            f"{tuple(target.shape)} (class labels want cross_entropy)"
        )
    return F.mse_loss(output.float(), target.reshape(output.shape).float())


#: the losses ``model.loss`` names
LOSSES: dict[str, Loss] = {"cross_entropy": cross_entropy_loss, "mse": mse_loss}


def resolve(reference: str, field: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names (the current directory is searched too, as
    ``python -m`` does)."""
    module_name, _, attr = reference.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except SystemExit as exc:  # the module called sys.exit() (or exit()) while being imported
        raise ConfigError(
            f"{field}={reference!r}: importing {module_name!r} called sys.exit({summary(exc.code)}); a "
            "model or data module must not exit when imported (move that code under "
            "`if __name__ == '__main__':`)"
        ) from None
    except Exception as exc:  # any error while importing the user's module
        raise ConfigError(
            f"{field}={reference!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc} "
            "(is it on PYTHONPATH or in the current directory?)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}={reference!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}={reference!r} is a {type(obj).__name__}, not a function")
    return cast(Callable[..., Any], obj)


def _call(fn: Callable[[], Any], reference: str, field: str) -> Any:
    try:
        return fn()
    except SystemExit as exc:
        raise ConfigError(
            f"{field}={reference!r} called sys.exit({summary(exc.code)}) when called with no arguments; "
            "it must return its model or dataset"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{field}={reference!r} failed when called with no arguments: {type(exc).__name__}: {exc}"
        ) from None


def _check_dataset(data: Any, what: str) -> None:
    if isinstance(data, IterableDataset) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        hint = ""
        if isinstance(data, DataLoader):
            hint = (
                f"; pass its dataset ({what}=loader.dataset): each rank's loader is made for you (a "
                "DistributedSampler over the dp ranks, data.global_batch_size, data.num_workers)"
            )
        elif isinstance(data, IterableDataset):
            hint = (
                "; a stream cannot be split by index over the ranks or resumed at a sample: give its "
                "samples as a map-style Dataset (e.g. torch.utils.data.TensorDataset), or train it in a loop "
                "of your own (docs/porting.md)"
            )
        raise ConfigError(
            f"{what} is a {type(data).__name__}: need a map-style torch Dataset (with __len__ and "
            f"__getitem__) of (input, target) pairs{hint}"
        )
    if len(data) == 0:
        raise ConfigError(f"{what} is empty")
    for i in (len(data) - 1, 0):  # the last too: a __len__ promising more than __getitem__ gives
        try:
            sample = data[i]
        except Exception as exc:
            raise ConfigError(
                f"{what}[{i}] raised {type(exc).__name__}: {exc} (its len() is {len(data)}); fix the "
                "dataset's __getitem__ or __len__"
            ) from None
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise ConfigError(
            f"{what}[0] is a {type(sample).__name__}"
            f"{f' of {len(sample)}' if isinstance(sample, tuple | list) else ''}: each sample must be "
            "an (input, target) pair"
            + (
                "; for tensors (x, y) pass torch.utils.data.TensorDataset(x, y)"
                if isinstance(data, tuple)
                else ""
            )
        )


def _split(data: Any, eval_fraction: float) -> tuple[Any, Any]:
    n = len(data)
    n_eval = max(1, int(n * eval_fraction))
    if n - n_eval < 1:
        raise ConfigError(f"data.eval_fraction={eval_fraction} leaves no training samples out of {n}")
    return Subset(data, range(n - n_eval)), Subset(data, range(n - n_eval, n))


def _loss(loss: Loss | str | None, field: str = "model.loss") -> Loss:
    if loss is None:
        return cross_entropy_loss
    if isinstance(loss, str):
        return LOSSES[loss] if loss in LOSSES else resolve(loss, field)
    if not callable(loss):
        raise ConfigError(f"loss_fn must be a function of (output, target) or a name, got {loss!r}")
    return loss


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return type(t).__name__


def _callable_without_arguments(build: Callable[..., Any], what: str) -> None:
    """Refuses a function building the model that needs arguments (the Trainer calls it with none)."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to read
        return
    try:
        signature.bind()
    except TypeError as exc:
        name = getattr(build, "__qualname__", type(build).__name__)
        raise ConfigError(
            f"{what} is called with no arguments, but {name}{signature} cannot be ({exc}); pass "
            "lambda: build(...) with its arguments, or the module itself"
        ) from None


def check_fit(
    task: Task,
    what_model: str,
    what_loss: str,
    check_model: Callable[[nn.Module], None] | None = None,
    data_hint: str = "",
) -> Task:
    """Build the model once and run the loss on two training samples: one clear error if it does not
    fit (and ``check_model``'s, on the built model), ending with ``data_hint``. Returns the task with
    ``classification`` and ``tokens_per_sample`` read off that batch."""
    _callable_without_arguments(task.build_model, what_model)
    with seeded_init(0):  # a probe: torch's global RNG is left as it was
        model = task.build_model()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{what_model} returned an object of type {type(model).__name__}, not a torch.nn.Module"
        )
    if check_model is not None:
        check_model(model)
    x, y = fetch(task.train_data, range(min(3, len(task.train_data))))
    if task.loss_fn is cross_entropy_loss and shifts_labels_inside(model):  # a copy task of your own: fine
        refuse_unshifted_labels(x, y, f"the training data with {what_loss}")
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:
        raise ConfigError(
            f"{what_model} does not take the data's inputs ({_describe(x)}): {type(exc).__name__}: {exc}"
            f"{data_hint}"
        ) from None
    try:
        loss = task.loss_fn(out, y)
    except Exception as exc:
        raise ConfigError(
            f"{what_loss} does not fit: loss(output {_describe(out)}, target {_describe(y)}) raised "
            f"{type(exc).__name__}: {exc}{data_hint}"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"{what_loss} returned {_describe(loss)} for output {_describe(out)} and target "
            f"{_describe(y)}: it must return one number (a 0-dim tensor, e.g. the batch mean)"
        )
    with contextlib.suppress(TypeError):
        out = logits_of(out)  # a Hugging Face output / a dict: its logits tell labels from values
    if not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor):
        return task
    labels = not y.is_floating_point() and out.dim() == y.dim() + 1
    if labels and out.dim() > 0:  # every target in range, over the whole of a small dataset
        scan_labels(task.train_data, int(out.shape[-1]), "training data")
        scan_labels(task.eval_data, int(out.shape[-1]), "held-out data")
    per_sample = int(y[0].numel()) if labels and y.dim() > 1 else task.tokens_per_sample
    return replace(task, classification=task.classification or labels, tokens_per_sample=per_sample)


def task_from_objects(
    config: TrainConfig,
    model: nn.Module | Callable[[], nn.Module] | None,
    train_data: Any,
    eval_data: Any = None,
    loss_fn: Loss | str | None = None,
    name: str = "custom",
) -> Task:
    """A task of Python objects (a module is deep-copied for each rank); checked as :func:`check_fit`."""
    if train_data is None:
        train_data, builtin_eval = builtin_data(config)
        eval_data = builtin_eval if eval_data is None else eval_data
    _check_dataset(train_data, "train_data")
    if eval_data is None:
        train_data, eval_data = _split(train_data, config.data.eval_fraction)
    _check_dataset(eval_data, "eval_data")
    tokens, units = 1, None
    if model is None:
        build, tokens, units = builtin_model(config)
    elif isinstance(model, nn.Module):
        template = model

        def build() -> nn.Module:
            return copy.deepcopy(template)  # each rank trains its own copy
    elif callable(model):
        build = model
    else:
        raise ConfigError(
            f"model must be an nn.Module or a function building one, got {type(model).__name__}"
        )
    task = Task(
        build,
        train_data,
        eval_data,
        _loss(loss_fn),
        tokens_per_sample=tokens,
        fsdp_unit_classes=units,
        name=name,
    )
    fits = None if model is None else partial(check_tensor_plan_fits, config)  # tp: heads, vocabulary
    return check_fit(task, "model", "loss_fn", fits)


def task_from_config(config: TrainConfig) -> Task:
    """``model.factory`` / ``data.factory`` / ``model.loss`` (each optional: the built-in otherwise)."""
    m, d = config.model, config.data
    if d.factory is None:
        train, evals = builtin_data(config)
    else:
        data = _call(resolve(d.factory, "data.factory"), d.factory, "data.factory")
        if isinstance(data, tuple) and len(data) == 2 and not isinstance(data[0], torch.Tensor):
            train, evals = data
            _check_dataset(train, f"data.factory={d.factory!r}'s train dataset")
            _check_dataset(evals, f"data.factory={d.factory!r}'s eval dataset")
        else:
            _check_dataset(data, f"data.factory={d.factory!r}'s result")
            train, evals = _split(data, d.eval_fraction)
    tokens, units = 1, None
    if m.factory is None:
        build, tokens, units = builtin_model(config)
        what = f"model.name={m.name!r}"
    else:
        fn, ref = resolve(m.factory, "model.factory"), m.factory
        build, what = (lambda: _call(fn, ref, "model.factory")), f"model.factory={m.factory!r}"
    loss = _loss(m.loss)
    name = m.factory or builtin_task_name(config)  # 'mypkg.models:build', not a bare 'build'
    task = Task(build, train, evals, loss, tokens_per_sample=tokens, fsdp_unit_classes=units, name=name)
    fits = None if m.factory is None else partial(check_tensor_plan_fits, config)  # tp: heads, vocabulary
    hint = ""
    if m.factory is not None and d.factory is None:  # your model on the built-in data: say so
        hint = (
            f"; without data.factory the data is the built-in data.dataset={d.dataset!r} "
            f"({'byte windows of the Python standard library' if d.dataset == 'stdlib' else '8x8 digits'}): "
            "set data.factory=package.module:function for your own"
        )
    return check_fit(task, what, f"model.loss={m.loss or 'cross_entropy'!r}", fits, hint)


def builtin_task_name(config: TrainConfig) -> str:
    return "stdlib-transformer-lm" if config.model.name == "transformer_lm" else "digits-cnn"
