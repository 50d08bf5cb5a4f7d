#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks.md, in two parts that each fit
# one 10-minute device call on a 4-GPU host (8 GPUs: set SITE_GPUS=4).
#   bash benchmarks/gpu_runs.sh sync    # issue 4: cross-site all-reduce acceptance
#                                        # issue 3: one 4-GPU site at the 1b preset
#   bash benchmarks/gpu_runs.sh sites   # issue 3: one site vs two sites, 1b preset
# Results go to $OUT (default ./gpu-results).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
site_gpus=${SITE_GPUS:-$((gpus / 2))}
nvidia-smi -L | tee "$out/gpus.txt"

case "${1:-}" in
  sync)
    python3 benchmarks/allreduce.py --sites 2 --rtt-ms 10 --gbit 1 --mib 256 \
      --codec raw,int8,int8+zstd:1 --json "$out/allreduce.json"
    python3 -m torch.distributed.run --nproc-per-node "$gpus" benchmarks/site_step.py \
      --preset 1b --dp "$gpus" --batch 8 --seq 2048 --compile --json "$out/site_step_1b.json"
    ;;
  sites)
    common=(--steps 8 --quiet --set model.preset=1b --set train.seq_len=2048
            --set train.batch_size=8 --set sync.codec=int8 --set wan.bandwidth_mbit=10000
            --set topology.device=cuda)
    python3 -m isthmus.deploy.cli local --sites 1 --ranks-per-site "$site_gpus" \
      "${common[@]}" --run-dir /tmp/one-site | tee "$out/one_site.txt"
    cp /tmp/one-site/summary.json "$out/one_site.json"
    python3 -m isthmus.deploy.cli local --sites 2 --ranks-per-site "$site_gpus" \
      "${common[@]}" --run-dir /tmp/two-sites | tee "$out/two_sites.txt"
    cp /tmp/two-sites/summary.json "$out/two_sites.json"
    ;;
  *)
    echo "usage: $0 sync|sites" >&2
    exit 2
    ;;
esac
