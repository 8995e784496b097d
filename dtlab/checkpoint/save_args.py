"""The arguments of :func:`~dtlab.checkpoint.save_checkpoint` checked on every rank before anything is
written: a value of another kind is one error naming it and what to pass (not an ``AttributeError``
halfway through a collective save, nor a step directory no resume would find)."""

from __future__ import annotations

import os
import re
from typing import cast

import torch

from dtlab.backends.base import check_backend
from dtlab.core.state import ShardedState
from dtlab.errors import ArgumentError, ArgumentTypeError, integer

__all__ = ["check_save_arguments"]

_TAG = re.compile(r"[A-Za-z0-9]+")


def check_save_arguments(
    root: object,
    step: object,
    backend: object,
    states: tuple[object, object, object, object],
    keep_last: object,
    run_tag: object,
) -> tuple[int, int]:
    """``step`` and ``keep_last`` as Python ints (NumPy's converted); ``states``: the model state, the
    optimizer state, the rank state and the metadata."""
    who = "save_checkpoint"
    if not isinstance(root, str | os.PathLike):
        raise ArgumentTypeError(f"{who}: root must be a directory path (str or Path), got {root!r}")
    counts = integer(step), integer(keep_last)
    for name, value, n in zip(("step", "keep_last"), (step, keep_last), counts, strict=True):
        if n is None or n < 0:
            raise ArgumentError(f"{who}: {name} must be an int >= 0, got {value!r}")
    check_backend(backend, who)
    model_state, optim_state, rank_state, meta = states
    if not isinstance(model_state, ShardedState):
        raise ArgumentTypeError(
            f"{who}: model_state must be a ShardedState (model.sharded_state_dict()), got "
            f"{type(model_state).__name__}"
        )
    if optim_state is not None and not isinstance(optim_state, ShardedState):
        raise ArgumentTypeError(
            f"{who}: optim_state must be a ShardedState (opt.sharded_state_dict()) or None, got "
            f"{type(optim_state).__name__}"
        )
    if not (isinstance(rank_state, dict) and all(isinstance(v, torch.Tensor) for v in rank_state.values())):
        raise ArgumentTypeError(
            f"{who}: rank_state must be a dict of tensors (e.g. {{}}), got {type(rank_state).__name__}"
        )
    if not isinstance(meta, dict):
        raise ArgumentTypeError(
            f"{who}: meta must be a dict of JSON values (e.g. {{}}), got {type(meta).__name__}"
        )
    if run_tag is not None and not (isinstance(run_tag, str) and _TAG.fullmatch(run_tag)):
        raise ArgumentError(f"{who}: run_tag must be letters and digits (or None), got {run_tag!r}")
    return cast(tuple[int, int], counts)
