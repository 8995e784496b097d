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
# two workers: process-starting tests one at a time on one of them (tests/conftest.py), in-memory
# tests on both; the order is random (pytest-randomly prints its seed: --randomly-seed=N repeats it)
exec python -m pytest -q -n 2 --dist loadgroup "$@"
