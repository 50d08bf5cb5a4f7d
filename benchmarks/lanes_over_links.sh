#!/usr/bin/env bash
# Issue 32's many-lane figures on one host: lanes over several emulated links, and 8
# lanes a site with no emulator, with the host's busy cores beside each case.
#
#   bash benchmarks/lanes_over_links.sh            # the cases below, REPEATS=3 of the first two
#
# Both sites, all their lanes and the emulator share the host, so each line also says how
# many of its cores were busy while the rounds ran (benchmarks/host_cpu.py). Writes one
# JSON per case and the host's samples under OUT (default lanes-over-links-results).
# MIB (4096), GBIT (25) and FLOW_MBIT (5000) size the cases; CUDA=0 skips CUDA tensors.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-lanes-over-links-results}
mib=${MIB:-4096}
gbit=${GBIT:-25}
flow=${FLOW_MBIT:-5000}
mkdir -p "$out"
nproc
lscpu | grep -m1 "Model name" || true
python3 benchmarks/host_cpu.py sample "$out/host-cpu.txt" &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
wan=(--sites 2 --rtt-ms 9.8 --gbit "$gbit" --per-flow-mbit "$flow" --relay-processes
  --codec raw --mib "$mib" --warmup 2 --repeats 3 --no-throughput)
direct=(--direct --sites 2 --rtt-ms 1 --gbit 10 --mib "$mib" --warmup 2 --repeats 3
  --no-throughput --connections 2)
run() {
  local name=$1 start end
  shift
  echo "== $name: $*"
  start=$(date +%s.%N)
  if python3 benchmarks/allreduce.py "$@" --json "$out/$name.json" | grep -E '^ +[0-9]+ '; then
    end=$(date +%s.%N)
    python3 benchmarks/host_cpu.py annotate "$out/$name.json" "$out/host-cpu.txt" "$start" "$end"
  else
    echo "   (failed: see above)"
  fi
}
for r in $(seq "${REPEATS:-3}"); do
  run "4lanes-2links-3conn-$r" "${wan[@]}" --lanes 4 --links 2 --connections 3
  run "4lanes-2links-$r" "${wan[@]}" --lanes 4 --links 2
done
run 4lanes-1link "${wan[@]}" --lanes 4 --links 1
# One lane a link with 3 connections: at most 3 x FLOW_MBIT a link (15 of 25 Gbit/s by
# default), so this case shows the per-flow cap holding, not the lanes' limit.
run 2lanes-2links-3conn "${wan[@]}" --lanes 2 --links 2 --connections 3
run 2lanes-1link "${wan[@]}" --lanes 2 --links 1
if [ "${CUDA:-1}" != 0 ] && nvidia-smi -L >/dev/null 2>&1; then
  run direct-8lanes-int8-cuda "${direct[@]}" --lanes 8 --codec int8 --device cuda
  run direct-8lanes-raw-cuda "${direct[@]}" --lanes 8 --codec raw --device cuda
fi
run direct-8lanes-raw-cpu "${direct[@]}" --lanes 8 --codec raw --chunk-kib 4096
