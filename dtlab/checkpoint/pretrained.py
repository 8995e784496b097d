"""``load_pretrained(model, path)``: safetensors weights into any wrapped model, each rank reading only
the slices it owns.

``path`` is one ``.safetensors`` file (Hugging Face's ``model.safetensors``, or the file ``dtlab
consolidate`` writes), a directory holding ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (its ``weight_map`` names the file of each tensor), or that index file
itself. Nothing is read that the rank does not hold: for every tensor the rank holds (whole, as a
tensor-parallel shard, or as the flat range of a ZeRO-3/FSDP shard of either), it reads the rows of
the file's tensor that cover its part through safetensors' lazy ``get_slice`` and copies them into its
own storage at once, so its peak is what it holds plus one tensor's slice: no second copy of the
shard, never the whole model. Every rank checks the tensors of its part against the file's header
first; the ranks then agree on one report (a pipeline rank knows only its own stages' tensors).
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

from dtlab.checkpoint._hf_names import file_names, ignored_unexpected
from dtlab.core.placement import Box, Placement, local_regions
from dtlab.core.shard_index import full_shape_of
from dtlab.errors import CheckpointError, check_path, check_switches
from dtlab.models import DataParallelModel, HybridShardedModel, ModelStrategy
from dtlab.models.base import OptimizerTarget

__all__ = ["PretrainedReport", "load_pretrained"]

_INDEX = "model.safetensors.index.json"


@dataclass
class PretrainedReport:
    """What ``load_pretrained`` did not load (empty lists after a strict load); the same on every rank."""

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
            if not target.is_file():
                raise CheckpointError(
                    f"load_pretrained: {path} maps {key!r} to {name!r}, which does not exist"
                )
            out[str(key)] = target
        return out
    return {"": path}


def _read_box(sl: Any, box: Box, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of ``box`` of the file's tensor flattened, reading only the box's rows
    (along dim 0) that cover them."""
    row = math.prod(box.sizes[1:])
    r0, r1 = a // row, -(-b // row)
    o0 = box.offsets[0]
    index = (slice(o0 + r0, o0 + r1), *box.slices()[1:])
    rows: torch.Tensor = sl[index]
    return rows.reshape(-1)[a - r0 * row : b - r0 * row]


@dataclass(frozen=True)
class _Held:
    """A tensor this rank holds (part of): its names (tied aliases), local shape and placement."""

    names: list[str]
    shape: list[int]
    placement: Placement
    coord: int
    size: int

    @property
    def full(self) -> list[int]:
        return full_shape_of(self.shape, self.placement, self.size)


class _Files:
    """The open safetensors files: which of a tensor's names the files hold, and lazy reads."""

    def __init__(self, by_key: dict[str, Path], stack: ExitStack, module: torch.nn.Module) -> None:
        self.handles: dict[Path, Any] = {}
        self.stack = stack
        if "" in by_key:
            one = by_key.pop("")
            by_key = dict.fromkeys(self.handle(one).keys(), one)
        renamed = file_names(module, by_key)  # a Hugging Face base model's checkpoint, or the reverse
        #: the model's name of each tensor -> its file's name (the same but where ``renamed``)
        self.in_file = {renamed.get(k, k): k for k in by_key}
        self.by_key = {renamed.get(k, k): f for k, f in by_key.items()}
        self.ignored = ignored_unexpected(module)

    def handle(self, file: Path) -> Any:
        if file not in self.handles:
            try:
                opened = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"load_pretrained: {file} is not a safetensors file ({exc})") from None
            self.handles[file] = self.stack.enter_context(opened)
        return self.handles[file]

    def find(self, names: list[str]) -> str | None:
        return next((n for n in names if n in self.by_key), None)

    def shape(self, key: str) -> list[int]:
        return [int(s) for s in self.handle(self.by_key[key]).get_slice(self.in_file[key]).get_shape()]

    def read(self, key: str, held: _Held, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of this rank's local tensor ``held``, flattened, read from ``key``."""
        handle = self.handle(self.by_key[key])
        if not held.shape:
            out: torch.Tensor = handle.get_tensor(self.in_file[key]).reshape(-1)
            return out
        sl = handle.get_slice(self.in_file[key])
        regions = local_regions(held.placement, held.full, held.coord, held.size, a, b)
        parts = [_read_box(sl, box, bs, be) for box, bs, be, _ in regions]
        return torch.cat(parts) if len(parts) != 1 else parts[0]


class _Part:
    """This rank's tensors: the flat units' slots (ZeRO-3/FSDP) and the tensors it holds whole."""

    def __init__(self, model: OptimizerTarget, dp: DataParallelModel) -> None:
        self.model, self.dp = model, dp
        aliases: dict[int, list[str]] = {}
        whole = dp.whole_state()
        for name, t in [*dp.module.named_parameters(remove_duplicate=False), *whole.items()]:
            if name not in aliases.setdefault(id(t), []):
                aliases[id(t)].append(name)
        self.aliases = aliases
        self.units = dp.flat_shards()
        sharded = {id(q) for st in self.units for q in st.unit.params}
        self.whole: list[tuple[_Held, torch.Tensor]] = []
        seen: set[int] = set()
        for key, t in whole.items():
            if id(t) not in sharded and id(t) not in seen:  # sharded below, or a tied alias
                seen.add(id(t))
                self.whole.append((self.held(key, aliases.get(id(t), [key]), list(t.shape)), t))

    def held(self, key: str, names: list[str], shape: list[int]) -> _Held:
        placement, coord, size = self.model.placed(key)
        return _Held(names, shape, placement, coord, size)

    def slots(self) -> list[tuple[Any, list[tuple[_Held, int, int, int]]]]:
        """Per flat unit: ``(held, start, end, shard_offset)`` of every slot this rank's shard covers
        (``start == end``: a slot of the unit it holds none of, listed for the check)."""
        out = []
        for st in self.units:
            mine = {s.name: (a, b, so) for s, a, b, so in st.unit.shard_slots()}
            rows = []
            for slot, q in zip(st.unit.slots, st.unit.params, strict=True):
                a, b, so = mine.get(slot.name, (0, 0, 0))
                rows.append(
                    (self.held(slot.name, self.aliases.get(id(q), [slot.name]), list(slot.shape)), a, b, so)
                )
            out.append((st, rows))
        return out


def _check(part: _Part, files: _Files) -> tuple[list[str], list[str], set[str], set[str]]:
    """This rank's missing and mis-shaped tensors, the file names it uses, and the names it can load."""
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    ok: set[str] = set()
    helds = [h for h, _ in part.whole] + [h for _, rows in part.slots() for h, *_ in rows]
    for held in helds:
        found = files.find(held.names)
        if found is None:
            missing.append(held.names[0])
            continue
        used.update(n for n in held.names if n in files.by_key)
        if files.shape(found) != held.full:
            mismatched.append(f"{found}: file shape {files.shape(found)}, model {held.full}")
        else:
            ok.add(found)
    return missing, mismatched, used, ok


def _agree(part: _Part, files: _Files) -> tuple[PretrainedReport, set[str]]:
    """The report of every rank's part together (the same on every rank) and what this rank loads."""
    missing, mismatched, used, ok = _check(part, files)
    every = part.model.world_backend.all_gather_object((missing, mismatched, sorted(used)))
    report = PretrainedReport()
    report.missing = list(dict.fromkeys(k for m, _, _ in every for k in m))
    report.mismatched = list(dict.fromkeys(k for _, m, _ in every for k in m))
    unused = set(files.by_key) - {k for _, _, u in every for k in u}
    ignored = files.ignored  # what Hugging Face's from_pretrained ignores in old checkpoints
    report.unexpected = sorted(
        files.in_file[k] for k in unused if ignored is None or ignored.search(files.in_file[k]) is None
    )
    return report, ok


def _load(part: _Part, files: _Files, ok: set[str]) -> None:
    with torch.no_grad():
        for held, t in part.whole:
            found = files.find(held.names)
            if found in ok:
                t.data.copy_(files.read(found, held, 0, t.numel()).view(t.shape))
        for st, rows in part.slots():
            for held, a, b, so in rows:
                found = files.find(held.names)
                if found in ok and b > a:
                    st.shard[so : so + b - a].copy_(files.read(found, held, a, b))
            if st.flat is not None:  # kept gathered (ZeRO-3's persistent units): every rank's shard
                part.dp.dp_backend.all_gather(st.flat, st.shard)


def load_pretrained(model: ModelStrategy, path: str | Path, *, strict: bool = True) -> PretrainedReport:
    """Load safetensors weights into ``model`` (DDP, ZeRO-1/2/3, FSDP, tensor, pipeline or hybrid
    parallel), each rank reading only its part.

    Keys are the wrapped module's ``state_dict()`` keys; a tied parameter loads once, from any of its
    names. Values are converted to the model's dtype. With ``strict`` (default) a missing,
    unexpected or mis-shaped key is a :class:`CheckpointError` naming them, before anything is
    loaded; with ``strict=False`` they are skipped (missing tensors keep their values) and listed in
    the returned report. Every rank calls it (collective: the ranks agree on the report)."""
    dp: DataParallelModel
    if isinstance(model, HybridShardedModel):
        dp = model.dp_strategy
    elif isinstance(model, DataParallelModel):
        dp = model
    else:
        raise CheckpointError(
            "load_pretrained loads into a dtlab model strategy (DDP, ZeRO-1/2/3, FSDP, tensor, pipeline or "
            f"hybrid), got {type(model).__name__}; wrap the module first"
        )
    check_path("load_pretrained", "path", path, "a file or directory")
    check_switches("load_pretrained", strict=strict)
    with ExitStack() as stack:
        whole = getattr(dp.module, "whole_model", dp.module)  # a pipeline rank's stages: the whole model's
        files = _Files(_files(Path(path)), stack, whole)
        part = _Part(model, dp)
        report, ok = _agree(part, files)
        if strict and (report.missing or report.unexpected or report.mismatched):
            raise CheckpointError(
                f"load_pretrained({str(path)!r}): missing {report.missing[:5]}, unexpected "
                f"{report.unexpected[:5]}, mis-shaped {report.mismatched[:5]}; fix the file or the model, "
                "or pass strict=False to load the rest and get them listed"
            )
        _load(part, files, ok)
    return report
