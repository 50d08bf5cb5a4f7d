#!/usr/bin/env bash
# Delayed outer rounds voted at landing (old code) against voted ahead (this tree), in
# one run: the exposed sync per step and where it falls.
#
#   bash benchmarks/vote_ahead_side_by_side.sh OLD_TREE
#
# OLD_TREE is a checkout of the code before `LaneGradientSync.vote_ahead` (e.g. `git
# worktree add /tmp/old 0a46f90`). Both run this tree's benchmarks/sync_modes.py on the
# same job (2 sites over the emulated 1000 km at 1 Gbit/s), alternating old and new
# REPEATS times (default 2). MODE (default streaming:20:4:4), STEPS (300), PRESET
# (small), RANKS (ranks per site, 1) and CODEC (int8) override the job; EXTRA adds --set
# options (GPUs: EXTRA="--set topology.device=cuda ..."). Tables go to stdout, JSON
# (each run's, and the summary) to $OUT (default vote-ahead-results).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
old=${1:?usage: $0 OLD_TREE}
out=${OUT:-vote-ahead-results}
mkdir -p "$out"
shim=$(mktemp -d)
runs=$(mktemp -d)
trap 'rm -rf "$shim" "$runs"' EXIT
ln -s "$(cd "$old" && pwd)" "$shim/isthmus" # the old tree imported as `isthmus`
# shellcheck disable=SC2206  # EXTRA is split into words on purpose
extra=(${EXTRA:-})
common=(--modes "${MODE:-streaming:20:4:4}" --steps "${STEPS:-300}" --preset "${PRESET:-small}"
        --ranks-per-site "${RANKS:-1}" --codec "${CODEC:-int8}" --steady-after 20
        --eval-every 0 --timeout 900 "${extra[@]}")
for r in $(seq "${REPEATS:-2}"); do
  echo "== old (voted at landing), repeat $r"
  PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/sync_modes.py "${common[@]}" \
    --out "$runs/old-$r" --json "$out/old-r$r.json"
  echo "== new (voted ahead), repeat $r"
  python3 benchmarks/sync_modes.py "${common[@]}" --out "$runs/new-$r" --json "$out/new-r$r.json"
done
python3 - "$out" "$runs" <<'EOF'
import glob, json, os, statistics, sys

out, runs = sys.argv[1], sys.argv[2]
rows = []
for path in sorted(glob.glob(f"{out}/*-r*.json")):
    name = os.path.basename(path)[: -len(".json")]
    ((mode, row),) = json.load(open(path))["rows"].items()
    waits = []  # every landing wait past 5 ms, at either site, from step 20 on
    for metrics in glob.glob(f"{runs}/{name.replace('-r', '-')}/*/sites/*/metrics.jsonl"):
        site = os.path.basename(os.path.dirname(metrics))
        for line in open(metrics):
            r = json.loads(line)
            if r.get("step", 0) >= 20 and r.get("exposed_sync_s", 0) > 0.005:
                waits.append((site, r["step"], r["exposed_sync_s"]))
    rows.append({
        "run": name, "mode": mode,
        "exposed_sync_s_per_step": row["exposed_sync_s_per_step"],
        "median_compute_s": row["median_compute_s"],
        "steady_tokens_per_s": row["steady_tokens_per_s"],
        "waits_over_5ms": len(waits),
        "median_wait_s": statistics.median(w for _, _, w in waits) if waits else 0.0,
        "waits": sorted(waits, key=lambda w: (w[1], w[0])),  # (site, step, seconds)
        "replicas_identical": row["replicas_identical"],
    })
print(f"{'run':8} {'mode':18} {'exposed s/step':>14} {'compute s':>10} {'tokens/s':>10} "
      f"{'waits>5ms':>9} {'median wait':>11} identical")
for r in rows:
    print(f"{r['run']:8} {r['mode']:18} {r['exposed_sync_s_per_step']:14.4f} "
          f"{r['median_compute_s']:10.4f} {r['steady_tokens_per_s']:10.0f} "
          f"{r['waits_over_5ms']:9d} {r['median_wait_s']:11.3f} {r['replicas_identical']}")
json.dump(rows, open(f"{out}/vote_ahead.json", "w"), indent=1)
print(f"wrote {out}/vote_ahead.json")
EOF
