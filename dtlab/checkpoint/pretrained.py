"""``load_pretrained(model, path)``: safetensors weights into a wrapped data-parallel model, each rank
reading only the slices it owns.

``path`` is one ``.safetensors`` file, a directory holding ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (its ``weight_map`` names the file of each tensor), or that index
file itself. Nothing is read whole that the rank does not hold whole: for a parameter ZeRO-3/FSDP
shard, the rank reads the rows covering its flat range (safetensors' lazy ``get_slice``), so its peak
is its shard plus at most two rows per tensor. The slices go through the model's own
``load_sharded_state_dict`` (as a checkpoint would).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError
from dtlab.models import DataParallelModel
from dtlab.models.state import add_slice, new_state

__all__ = ["PretrainedReport", "load_pretrained"]

_INDEX = "model.safetensors.index.json"


@dataclass
class PretrainedReport:
    """What ``load_pretrained`` did not load (empty lists after a strict load)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: file shape [..], model [..]"


def _files(path: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it (an empty map means: every key of the one file)."""
    if path.is_dir():
        if (path / _INDEX).is_file():
            path = path / _INDEX
        elif (path / "model.safetensors").is_file():
            return {"": path / "model.safetensors"}
        else:
            raise CheckpointError(f"load_pretrained: {path} holds neither model.safetensors nor {_INDEX}")
    if not path.is_file():
        raise CheckpointError(f"load_pretrained: {path} does not exist")
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"load_pretrained: {path} is not a safetensors index ({exc})") from None
        out = {}
        for key, name in weight_map.items():
            target = (path.parent / str(name)).resolve()
            if target.parent != path.parent.resolve():
                raise CheckpointError(f"load_pretrained: {path} maps {key!r} outside its folder ({name!r})")
            out[str(key)] = target
        return out
    return {"": path}


def _read_range(sl: Any, shape: list[int], a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of the flattened tensor, reading only the rows that cover them."""
    if not shape:  # read whole by _Files.slice
        return sl.reshape(-1)[a:b]  # type: ignore[no-any-return]
    if len(shape) == 1:
        out: torch.Tensor = sl[a:b]
        return out
    row = math.prod(shape[1:])
    r0, r1 = a // row, -(-b // row)
    rows: torch.Tensor = sl[r0:r1]
    return rows.reshape(-1)[a - r0 * row : b - r0 * row]


class _Files:
    """The open safetensors files and which keys were used; finds a tensor under any of its names."""

    def __init__(self, by_key: dict[str, Path], stack: ExitStack, report: PretrainedReport) -> None:
        self.handles: dict[Path, Any] = {}
        self.stack, self.report, self.used = stack, report, set[str]()
        if "" in by_key:
            one = by_key.pop("")
            by_key = dict.fromkeys(self.handle(one).keys(), one)
        self.by_key = by_key

    def handle(self, file: Path) -> Any:
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        return self.handles[file]

    def slice(self, names: list[str], shape: list[int]) -> Any:
        """The lazy slice of the first of ``names`` in the files; ``None`` (listed) if missing or
        mis-shaped. A 0-dimensional tensor is read whole."""
        found = next((n for n in names if n in self.by_key), None)
        if found is None:
            self.report.missing.append(names[0])
            return None
        self.used.update(n for n in names if n in self.by_key)
        sl = self.handle(self.by_key[found]).get_slice(found)
        if list(sl.get_shape()) != shape:
            self.report.mismatched.append(f"{found}: file shape {list(sl.get_shape())}, model {shape}")
            return None
        return sl if shape else self.handle(self.by_key[found]).get_tensor(found)


def _aliases(model: DataParallelModel) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    named = [*model.module.named_parameters(remove_duplicate=False)]
    for name, t in [*named, *model.whole_state().items()]:
        if name not in out.setdefault(id(t), []):
            out[id(t)].append(name)
    return out


def _slices(model: DataParallelModel, files: _Files) -> ShardedState:
    """This rank's part of every tensor: its flat ranges of the sharded units, the rest whole."""
    aliases = _aliases(model)
    state = new_state("pretrained", 1, 0)
    shards = list(model.flat_shards())
    sharded = {id(q) for st in shards for q in st.unit.params}
    for st in shards:
        mine = {s.name: (a, b, so) for s, a, b, so in st.unit.shard_slots()}
        for q, slot in zip(st.unit.params, st.unit.slots, strict=True):
            sl = files.slice(aliases.get(id(q), [slot.name]), list(slot.shape))
            if slot.name not in mine:
                continue  # none of it on this rank
            a, b, so = mine[slot.name]
            data = st.shard[so : so + b - a] if sl is None else _read_range(sl, list(slot.shape), a, b)
            add_slice(state, slot.name, slot.shape, st.unit.dtype, a, b, data)
    done: set[int] = set()
    for key, t in model.whole_state().items():
        if id(t) in sharded or id(t) in done:  # sharded above, or a tied alias
            continue
        done.add(id(t))
        sl = files.slice(aliases.get(id(t), [key]), list(t.shape))
        add_slice(
            state,
            key,
            t.shape,
            t.dtype,
            0,
            t.numel(),
            t.detach() if sl is None else sl[...] if t.dim() == 0 else sl[:],
        )
    return state


def load_pretrained(model: DataParallelModel, path: str | Path, *, strict: bool = True) -> PretrainedReport:
    """Load safetensors weights into ``model`` (DDP, ZeRO-1/2/3, FSDP), each rank reading its part.

    Keys are the wrapped module's ``state_dict()`` keys; a tied parameter loads from any of its names.
    With ``strict`` (default) a missing, unexpected or mis-shaped key is a :class:`CheckpointError`
    naming them; with ``strict=False`` they are skipped (missing tensors keep their values) and listed
    in the returned report. Every rank calls it (the model's load may all-gather gathered units)."""
    if not isinstance(model, DataParallelModel):
        raise CheckpointError(
            f"load_pretrained loads into DDP, ZeRO-1/2/3 or FSDP models, got {type(model).__name__}"
        )
    report = PretrainedReport()
    with ExitStack() as stack:
        files = _Files(_files(Path(path)), stack, report)
        state = _slices(model, files)
        report.unexpected = sorted(set(files.by_key) - files.used)
    if strict and (report.missing or report.unexpected or report.mismatched):
        raise CheckpointError(
            f"load_pretrained({str(path)!r}): missing {report.missing[:5]}, unexpected "
            f"{report.unexpected[:5]}, mis-shaped {report.mismatched[:5]}; fix the file or the model, or "
            "pass strict=False to load the rest and get them listed"
        )
    model.load_sharded_state_dict([state])
    return report
