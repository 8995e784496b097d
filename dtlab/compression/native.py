"""Building and loading the compiled compression kernels (:mod:`dtlab.compression.kernels`,
:mod:`dtlab.compression.powersgd_kernels`).

The kernels are plain C (:mod:`~dtlab.compression.kernel_source`,
:mod:`~dtlab.compression.powersgd_source`) compiled once per machine with the system C compiler
(``cc``, or ``$CC``; about 5 s of CPU time) into one shared library in a cache directory
(``$DTLAB_KERNEL_CACHE``, default ``~/.cache/dtlab/kernels``, keyed by a hash of the source, the flags
and the CPU) and called through ``ctypes``, which releases the GIL. ``-ffp-contract=off``: no fused
multiply-add the source does not ask for. Where no compiler can build them (or with
``DTLAB_NATIVE_KERNELS=0``) :func:`native` returns ``None`` and the callers run their torch fallbacks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from dtlab.compression.kernel_source import SIGNATURES as _KERNEL_SIGNATURES
from dtlab.compression.kernel_source import SOURCE as _KERNEL_SOURCE
from dtlab.compression.powersgd_source import SIGNATURES as _PSGD_SIGNATURES
from dtlab.compression.powersgd_source import SOURCE as _PSGD_SOURCE

__all__ = ["native", "native_enabled"]

_SOURCE = _KERNEL_SOURCE + _PSGD_SOURCE
_SIGNATURES = {**_KERNEL_SIGNATURES, **_PSGD_SIGNATURES}
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-march=native"]


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (the cache key)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "|".join(sorted({ln for ln in lines if ln.startswith(("flags", "model name", "Features"))}))


def _cache_dir() -> Path:
    env = os.environ.get("DTLAB_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dtlab" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then loaded from the cache); ``None`` when no C
    compiler can build them here (logged once; the torch fallbacks run)."""
    key = _SOURCE + " ".join(_FLAGS) + platform.machine() + _cpu_signature()
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = _cache_dir() / f"dtlab_kernels_{tag}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, lib = Path(tmp) / "kernels.c", Path(tmp) / "kernels.so"
                src.write_text(_SOURCE)
                cc = os.environ.get("CC", "cc")
                cmd = [cc, *_FLAGS, str(src), "-o", str(lib), "-lm"]
                if subprocess.run(cmd, capture_output=True).returncode != 0:  # no -march=native here
                    cmd.remove("-march=native")
                    subprocess.run(cmd, check=True, capture_output=True)
                os.replace(lib, path)  # atomic: concurrent builders leave one complete file
        dll = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (
            exc.stderr.decode(errors="replace")[-500:]
            if isinstance(exc, subprocess.CalledProcessError)
            else exc
        )
        logging.getLogger(__name__).warning(
            "dtlab compression kernels could not be built (%s); the plain torch fallbacks run instead "
            "(install a C compiler, or set DTLAB_NATIVE_KERNELS=0 to silence this)",
            detail,
        )
        return None
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = res, args
    return dll


def native_enabled() -> bool:
    """Whether the compiled kernels are used for CPU tensors (``DTLAB_NATIVE_KERNELS=0`` turns them off)."""
    return os.environ.get("DTLAB_NATIVE_KERNELS", "1") != "0" and _library() is not None


def native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels' library when every tensor is a contiguous CPU tensor and the kernels are enabled
    and built here; ``None`` otherwise (the caller runs its torch fallback)."""
    if os.environ.get("DTLAB_NATIVE_KERNELS", "1") == "0":
        return None
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    return _library()
