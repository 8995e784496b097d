"""Compressor state in checkpoints, generically: tensors into the safetensors shard, the rest as JSON.

A compressor's per-buffer state (:meth:`~dtlab.compression.Compressor.new_state`) is a plain dict of
tensors, numbers, strings, ``None``, lists, tuples, string-keyed dicts and ``torch.Generator`` objects.
:func:`encode_state` turns it into a JSON document and a set of named tensors (a generator becomes its
``get_state()`` uint8 tensor); :func:`decode_state` rebuilds it exactly. Nothing is pickled, and no
algorithm needs code of its own: a new compressor is covered as long as its state stays plain.

Scratch objects (reused buffers such as :class:`~dtlab.compression.sparse.Magnitudes`) derive from
:class:`Workspace`: they hold nothing that affects results, are never saved, and come back fresh from
``new_state`` on load. Any other type is refused with an error naming the field.

JSON encoding: ``None``, bools, ints, strings and finite floats are themselves (Python's float ``repr``
round-trips exactly); every other value is a one-key object: ``{"tensor": name}``,
``{"generator": name, "device": "cpu"}``, ``{"float": "inf"}``, ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"dict": {...}}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from dtlab.errors import CheckpointError

__all__ = ["Buffers", "Workspace", "decode_state", "encode_state"]

_SUPPORTED = "tensors, numbers, strings, None, lists, tuples, string-keyed dicts and torch.Generator objects"


class Workspace:
    """Base of scratch objects kept in a compressor's state dict: reused buffers that never affect
    results. They are left out of checkpoints; ``new_state`` makes a fresh one on load."""


class Buffers(Workspace):
    """Named scratch tensors reused from one iteration to the next: a fresh buffer of hundreds of MB
    costs more in page faults on first touch than the pass that fills it. A buffer handed out stays
    valid until the same name is asked for again (the next iteration)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat ``numel``-element tensor (the start of a buffer kept at its largest size so far)."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def encode_state(state: Mapping[str, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """JSON document of ``state``; its tensors are added to ``tensors`` under names ``prefix + field``."""
    doc: dict[str, Any] = {}
    for field, value in state.items():
        if isinstance(value, Workspace):
            continue
        doc[field] = _encode(value, prefix + field, tensors)
    return doc


def decode_state(
    doc: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """Inverse of :func:`encode_state`; tensors are moved to ``device``."""
    if not isinstance(doc, Mapping):
        raise CheckpointError(f"compressor state must be a JSON object, got {type(doc).__name__}")
    return {field: _decode(value, tensors, device, field) for field, value in doc.items()}


def _encode(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"tensor": name}
    if isinstance(value, torch.Generator):
        tensors[name] = value.get_state()
        return {"generator": name, "device": str(value.device)}
    if isinstance(value, list | tuple):
        items = [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
        return {"list" if isinstance(value, list) else "tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, f"{name}.{k}", tensors) for k, v in value.items()}}
    raise TypeError(
        f"compressor state {name!r} holds a {type(value).__name__}, which checkpoints cannot store; "
        f"keep compressor state as {_SUPPORTED}, or derive scratch objects that never affect results "
        f"from dtlab.compression.state_io.Workspace (left out of checkpoints, rebuilt by new_state)"
    )


def _decode(doc: Any, tensors: Mapping[str, torch.Tensor], device: torch.device, where: str) -> Any:
    if doc is None or isinstance(doc, bool | int | float | str):
        return doc
    if not isinstance(doc, dict) or len(doc) not in (1, 2):
        raise CheckpointError(f"compressor state {where!r}: unexpected JSON value {doc!r}")
    if "tensor" in doc or "generator" in doc:
        name = doc["tensor"] if "tensor" in doc else doc["generator"]
        if not isinstance(name, str) or name not in tensors:
            raise CheckpointError(
                f"compressor state {where!r} names tensor {name!r}, which is missing from the shard"
            )
        if "tensor" in doc:
            return tensors[name].to(device)
        gen = torch.Generator(device=doc.get("device", "cpu"))
        gen.set_state(tensors[name].to(torch.uint8).cpu())
        return gen
    if "float" in doc:
        return float(doc["float"])
    if "list" in doc:
        return [_decode(v, tensors, device, f"{where}[{i}]") for i, v in enumerate(doc["list"])]
    if "tuple" in doc:
        return tuple(_decode(v, tensors, device, f"{where}[{i}]") for i, v in enumerate(doc["tuple"]))
    if "dict" in doc and isinstance(doc["dict"], dict):
        return {k: _decode(v, tensors, device, f"{where}.{k}") for k, v in doc["dict"].items()}
    raise CheckpointError(f"compressor state {where!r}: unexpected JSON value {doc!r}")
