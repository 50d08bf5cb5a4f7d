#!/usr/bin/env bash
# Install isthmus (editable) and its dependencies into the current Python.
#
#   bash scripts/install.sh          # runtime only
#   bash scripts/install.sh --dev    # plus pytest, grpcio-tools, ruff, shellcheck; as root
#                                    # with apt: iptables, iproute2, slurm-wlm, munge
#
# An installed torch >= 2.11 is kept (the GPU machines bring their CUDA build).
# Otherwise torch 2.13.0 is installed first, pinned: on the development machines
# that is the CPU wheel on local disk, and an unpinned `torch` would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extra=""
case "${1:-}" in
  --dev) extra="[dev]" ;;
  "") ;;
  *) echo "usage: $0 [--dev]" >&2; exit 2 ;;
esac

if [ -n "$extra" ]; then
  # The transparent-mode tests put sites in network namespaces behind iptables rules;
  # the Slurm test (tests/deploy/test_slurm.py) runs a one-node Slurm of its own.
  packages=()
  command -v iptables >/dev/null 2>&1 || packages+=(iptables iproute2)
  command -v slurmctld >/dev/null 2>&1 || packages+=(slurm-wlm munge)
  if [ "${#packages[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      # ~13 s on a fresh Debian 12 (download included); recommends would double it.
      echo "installing ${packages[*]} (for the network-namespace and Slurm tests)" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${packages[@]}" >/dev/null
    else
      echo "note: the network-namespace and Slurm tests need root and ${packages[*]}" >&2
    fi
  fi
fi

python=${PYTHON:-python3}
if ! "$python" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
then
  echo "installing torch==2.13.0" >&2
  "$python" -m pip install --quiet torch==2.13.0
fi
# Builds wirecore's C extension too (setup.py; without a C compiler the lanes use the same
# path in Python, and say so in their log).
"$python" -m pip install --quiet -e ".${extra}"
# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set (the CI machines set it)
# every process compiles again each module it imports, ~0.3-0.5 s a rank, and a job or
# the test suite starts many. A source changed later is compiled again in memory.
"$python" -m compileall -q -j 0 -x '/\.' . >/dev/null ||
  echo "note: could not byte-compile the package (it runs, a little slower to start)" >&2
echo "isthmus installed: $(command -v isthmus || echo "$python -m isthmus.deploy.cli")" >&2
