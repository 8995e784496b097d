#!/usr/bin/env bash
# The main job: installs what it needs, then trains on the embedded default (4 in-memory ranks).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -f .venv/.dtlab-installed ]; then
  echo "run.sh: installing into ./.venv: torch 2.13 (CPU), then dtlab and its test tools (pip install -e .[dev]);" \
       "about a minute the first time, nothing after" >&2
fi
scripts/venv.sh
exec .venv/bin/dtlab train "$@"
