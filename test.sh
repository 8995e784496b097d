#!/usr/bin/env bash
# The test command: installs what it needs, then lint (ruff), types (mypy) and the test suite.
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh
scripts/slurm-packages.sh  # slurm-wlm + munge for tests/test_slurm.py where apt-get and root allow
export PATH="$PWD/.venv/bin:$PATH"
ruff check dtlab tests benchmarks examples
ruff format --check dtlab
mypy dtlab
exec python -m pytest -q "$@"
