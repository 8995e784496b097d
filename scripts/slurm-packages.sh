#!/usr/bin/env bash
# Installs Debian's slurm-wlm and munge for tests/test_slurm.py (a one-node Slurm the test starts
# itself), where that is possible: as root, with apt-get, and only when srun is missing. Anything
# else (no root, no apt-get, no network) just says so: the Slurm test then skips with the reason.
set -uo pipefail
command -v srun >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "slurm-packages: not root or no apt-get: Slurm not installed (tests/test_slurm.py will skip)"
  exit 0
fi
echo "slurm-packages: installing slurm-wlm and munge with apt-get (for tests/test_slurm.py)"
export DEBIAN_FRONTEND=noninteractive
if ! timeout 300 apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; then
  timeout 120 apt-get update -qq >/dev/null 2>&1
  timeout 300 apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
    || echo "slurm-packages: apt-get could not install slurm-wlm munge (tests/test_slurm.py will skip)"
fi
exit 0
