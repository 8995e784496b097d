#!/usr/bin/env bash
# Create ./.venv and install dtlab with what the tests need. torch==2.13.0 goes first: on this
# project's machines it is a CPU wheel on disk; any other spec may pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dtlab-installed
want="$(cat pyproject.toml scripts/venv.sh | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
