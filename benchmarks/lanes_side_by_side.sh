#!/usr/bin/env bash
# N lanes per site, old code against this tree, in one run (issues 11 and 32).
#
#   bash benchmarks/lanes_side_by_side.sh OLD_TREE [LANES...]
#
# OLD_TREE is a checkout of the package folders to compare with (e.g. `git worktree add
# /tmp/old <commit>`; its deploy/commands/bench.py needs --direct). Both run
# `benchmarks/allreduce.py --direct` (two sites, no emulator: the lanes' own limit) with
# the same flags, alternating old and new REPEATS times, for each device in DEVICES
# (default "cpu"; "cpu cuda" adds CUDA tensors, each site's lanes on GPUs of their own
# where there are enough). Chunks are 4 MiB for CPU tensors and 16 MiB for CUDA ones,
# as training sizes them on the bulk port. The table's "cpu s/GB" column is the
# process CPU time per GB of tensor. Tables go to stdout, JSON to $OUT.
# MIB (256), CODECS (raw,int8), REPEATS (2), CONNECTIONS (2), ROUNDS (3: timed rounds
# per run, the median shown) and WARMUP (2: untimed full-size rounds first, since a
# lane's first two pay for allocations that later ones reuse, e.g. the pinned memory of
# a CUDA lane's payloads) override the defaults. An old tree without `--warmup` (before
# 2026-12-03) runs WARMUP more timed rounds instead, and its median is of those.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
old=${1:?usage: $0 OLD_TREE [LANES...]}
shift
lanes=("$@")
[ ${#lanes[@]} -gt 0 ] || lanes=(1)
out=${OUT:-lanes-results}
mkdir -p "$out"
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$(cd "$old" && pwd)" "$shim/isthmus" # the old tree imported as `isthmus`
for device in ${DEVICES:-cpu}; do
  chunk=4096
  [ "$device" = cuda ] && chunk=16384
  common=(--direct --sites 2 --rtt-ms 1 --gbit 10 --mib "${MIB:-256}" --chunk-kib "$chunk"
          --codec "${CODECS:-raw,int8}" --connections "${CONNECTIONS:-2}" --no-throughput
          --device "$device" --repeats "${ROUNDS:-3}")
  warm=(--warmup "${WARMUP:-2}")
  old_warm=("${warm[@]}")
  if ! grep -q -- '"--warmup"' "$old/deploy/commands/bench.py"; then
    old_warm=(--repeats "$(( ${ROUNDS:-3} + ${WARMUP:-2} ))") # the last --repeats wins
  fi
  for r in $(seq "${REPEATS:-2}"); do
    for n in "${lanes[@]}"; do
      echo "== old, $device, $n lane(s) per site, repeat $r"
      PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/allreduce.py \
        "${common[@]}" "${old_warm[@]}" --lanes "$n" --json "$out/old-$device-lanes$n-r$r.json"
      echo "== new, $device, $n lane(s) per site, repeat $r"
      python3 benchmarks/allreduce.py "${common[@]}" "${warm[@]}" --lanes "$n" \
        --json "$out/new-$device-lanes$n-r$r.json"
    done
  done
done
python3 benchmarks/lanes_summary.py "$out" --json "$out/summary.json"
