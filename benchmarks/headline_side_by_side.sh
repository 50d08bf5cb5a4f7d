#!/usr/bin/env bash
# The issue 11 headline, old code and new in one run: 1b preset, one site of SITE_GPUS
# GPUs vs two such sites over an emulated 1000 km, 10 Gbit/s link, int8 (CODEC).
#
#   bash benchmarks/headline_side_by_side.sh OLD_TREE
#
# For each per-GPU batch in BATCHES (default "8 16"; x 2048 tokens): this tree's
# scaling curve (benchmarks/scaling_curve.py: one site, two sites, the plan), then the
# old tree's two-site run at the same batch (OLD_TREE imported as `isthmus`, as in
# lanes_side_by_side.sh). Prints each run's steady-state figures and writes them to
# $OUT/headline.json. STEPS (default 10), WARMUP (3) and EXTRA (more --set options for
# every run, e.g. "--set parallel.activation_checkpoint=true") as in gpu_runs.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
old=${1:?usage: $0 OLD_TREE}
out=${OUT:-gpu-results}
mkdir -p "$out"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
site_gpus=${SITE_GPUS:-$((gpus / 2))}
codec=${CODEC:-int8}
steps=${STEPS:-10}
warmup=${WARMUP:-3}
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$(cd "$old" && pwd)" "$shim/isthmus"
# shellcheck disable=SC2206  # EXTRA is split into words on purpose
link=(--set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 --set topology.device=cuda
      ${EXTRA:-})
for batch in ${BATCHES:-8 16}; do
  python3 benchmarks/scaling_curve.py --out "$out/new" --batches "$batch" --preset 1b \
    --seq 2048 --sites 2 --ranks-per-site "$site_gpus" --codec "$codec" --steps "$steps" \
    --warmup "$warmup" "${link[@]}" | tee -a "$out/new.txt"
  PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" timeout 600 python3 -m isthmus.deploy.cli local \
    --quiet --sites 2 --ranks-per-site "$site_gpus" --steps "$steps" \
    --set model.preset=1b --set train.seq_len=2048 --set "train.batch_size=$batch" \
    --set "sync.codec=$codec" --set "run.steady_after=$warmup" "${link[@]}" \
    --run-dir "$out/old/two-b$batch" | tail -16 | tee -a "$out/old.txt" || true
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for summary in sorted(out.glob("*/*/summary.json")):
    s = json.loads(summary.read_text())
    rows.append({"run": f"{summary.parent.parent.name}/{summary.parent.name}", **{
        k: s.get(k) for k in ("steady_tokens_per_s", "steady_step_s", "exposed_sync_s_per_step",
                              "steady_steps", "digests")}})
for r in rows:
    print(f"{r['run']:<28} {r['steady_tokens_per_s'] or 0:>10,.0f} tok/s  "
          f"{r['steady_step_s'] or 0:6.3f} s/step  exposed {r['exposed_sync_s_per_step'] or 0:.3f} s/step")
(out / "headline.json").write_text(json.dumps(rows, indent=2) + "\n")
PY
