"""Run ``dtlab`` command lines in one child process under an address-space limit (``RLIMIT_AS``).

The limit is what "bounded memory" means in the tests of untrusted input: an input that would make
dtlab allocate more than the cap (a shard read whole, an alias bomb expanded) ends in ``MemoryError``
inside the child, which the tests see as exit status 1 and a traceback instead of the named error.
Several command lines share one child (one torch import), each run through ``dtlab.cli.main``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the cap (bytes of address space); importing torch takes about 0.7 GB of it
CAP = 1_600 * 2**20

_CHILD = r"""
import contextlib, io, json, sys, traceback
from dtlab.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc(file=err)
            rc = 1
    out.append({"argv": argv, "rc": rc, "stderr": err.getvalue()[-4000:]})
print(json.dumps(out))
"""


def _limit(cap: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def run_cli(cases: list[list[str]], cwd: Path, cap: int = CAP, timeout: float = 240) -> list[dict[str, Any]]:
    """``[{"argv", "rc", "stderr"}]`` for each command line, run in order in one capped child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=lambda: _limit(cap),
    )
    assert proc.returncode == 0, f"the capped child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
