"""Sharded, atomic, reshardable checkpoints: safetensors shards per rank plus one JSON metadata file.

Layout of ``<dir>/step_00000100/``: ``model_rank00000.safetensors`` (and one per saved rank),
``optim_rank00000.safetensors``, ``state_rank00000.safetensors`` (RNG states), ``meta.json``
(strategy, world size, step, config, data position, per-rank shard metadata, a SHA-256 per file).
``<dir>/latest`` names the newest complete step directory. Loading never unpickles.
``find_resume_checkpoint`` chooses what a resume takes when ``latest`` is missing or broken.
"""

from dtlab.checkpoint.consolidate import consolidate, full_tensors_from_shards
from dtlab.checkpoint.load import LoadedCheckpoint, read_checkpoint, resolve_checkpoint
from dtlab.checkpoint.pretrained import PretrainedReport, load_pretrained
from dtlab.checkpoint.resume import ResumePoint, find_resume_checkpoint
from dtlab.checkpoint.save import save_checkpoint

__all__ = [
    "LoadedCheckpoint",
    "PretrainedReport",
    "ResumePoint",
    "consolidate",
    "find_resume_checkpoint",
    "full_tensors_from_shards",
    "load_pretrained",
    "read_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
]
