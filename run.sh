#!/usr/bin/env bash
# The main job: installs what it needs, then trains on the embedded default (4 in-memory ranks).
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh
exec .venv/bin/dtlab train "$@"
