#!/usr/bin/env bash
# The test command: installs what it needs, then lint (ruff), types (mypy) and the test suite.
set -euo pipefail
cd "$(dirname "$0")"
scripts/venv.sh
scripts/slurm-packages.sh  # slurm-wlm + munge for tests/test_slurm.py where apt-get and root allow
export PATH="$PWD/.venv/bin:$PATH"
ruff check dtlab tests examples scripts
ruff format --check dtlab
mypy dtlab
# two workers: process-starting tests one at a time on one of them (tests/conftest.py), in-memory
# tests on both; the order is random (pytest-randomly), its seed printed here: pass
# --randomly-seed=N (or set DTLAB_TEST_SEED=N) to repeat an order
seed="${DTLAB_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
echo "test order: --randomly-seed=$seed"
exec python -m pytest -q -n 2 --dist loadgroup --durations=25 --randomly-seed="$seed" "$@"
