"""Which peer died: every process of a ``torch.distributed`` job started by dtlab publishes its host and
pid in the job's store (under torchrun the agent hosts it, so it outlives any worker); a rank whose
collective lost its connection looks up its group's peers and names those whose process is gone on
this host. Peers on other hosts, or a store that went with the dead process, leave the rank unnamed."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["gone_peers", "publish_identity"]

_KEY = "dtlab/identity/{}"


def publish_identity() -> None:
    """Record this process's host and pid under its global rank (best effort: never fails a start)."""
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - torch.distributed's store (no public accessor)
        store.set(_KEY.format(dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # a store without set, a closed store: the rank stays unnamed on failure
        pass


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie has exited: its parent has not collected it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def gone_peers(group: dist.ProcessGroup | None, wait: float = 1.0) -> str:
    """``"rank 2 (pid 4242 on this host)"`` for each peer of ``group`` whose process is gone (global
    ranks), waiting up to ``wait`` s for a dying process to be gone; ``""`` when none can be named."""
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - torch.distributed's store (no public accessor)
        me, host = dist.get_rank(), socket.gethostname()
        peers = [r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != me]
        local: dict[int, int] = {}
        for r in peers:
            key = _KEY.format(r)
            if store.check([key]):
                h, pid = store.get(key).decode().split()
                if h == host:
                    local[r] = int(pid)
    except Exception:  # the store went with the dead process (it hosted it), or was never written
        return ""
    deadline = time.monotonic() + wait
    while True:
        dead = [f"rank {r} (pid {pid} on this host)" for r, pid in local.items() if _gone(pid)]
        if dead or time.monotonic() >= deadline:
            return ", ".join(dead)
        time.sleep(0.05)
