#!/usr/bin/env bash
# The cross-site sync as training drives it, without the model (issue 11): each lane's
# slice on a GPU of its own, split into FSDP-like groups started one after another
# while matrix products stand in for backward, over an emulated link. Tells how much
# of the sync hides behind compute, and what the data plane moves, in seconds.
#
#   bash benchmarks/sync_under_load.sh [OLD_TREE] [-- more allreduce.py flags]
#
# Defaults model the issue 11 headline: 2 sites, GPUs/2 lanes per site, the 1b
# preset's gradient (3930 MiB fp32 per site), 21 groups, 4 rounds in flight, 800 ms of
# backward, int8, 10 Gbit/s, 9.8 ms RTT. MIB, NGROUPS, LOAD_MS, IN_FLIGHT, CODECS, GBIT,
# RTT_MS, LANES, DEVICE override them. With OLD_TREE (a checkout to compare with; its
# bench needs this tree's inter/data/bench.py and deploy/commands/bench.py), old and new run
# alternately, REPEATS times. Tables to stdout, JSON to $OUT.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
old=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then old=$1; shift; fi
[ "${1:-}" != "--" ] || shift
out=${OUT:-sync-results}
mkdir -p "$out"
device=${DEVICE:-cuda}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
lanes=${LANES:-$(( gpus >= 2 ? gpus / 2 : 1 ))}
common=(--sites 2 --lanes "$lanes" --device "$device" --rtt-ms "${RTT_MS:-9.8}"
        --gbit "${GBIT:-10}" --mib "${MIB:-3930}" --codec "${CODECS:-int8}"
        --groups "${NGROUPS:-21}" --in-flight "${IN_FLIGHT:-4}" --load-ms "${LOAD_MS:-800}"
        --no-throughput "$@")
shim=""
if [ -n "$old" ]; then
  shim=$(mktemp -d)
  trap 'rm -rf "$shim"' EXIT
  ln -s "$(cd "$old" && pwd)" "$shim/isthmus" # the old tree imported as `isthmus`
fi
for r in $(seq "${REPEATS:-1}"); do
  if [ -n "$old" ]; then
    echo "== old, repeat $r"
    PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/allreduce.py "${common[@]}" \
      --json "$out/old-r$r.json"
  fi
  echo "== new, repeat $r"
  python3 benchmarks/allreduce.py "${common[@]}" --json "$out/new-r$r.json"
done
