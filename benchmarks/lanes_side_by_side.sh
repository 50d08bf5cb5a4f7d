#!/usr/bin/env bash
# One lane and N lanes per site, old code against this tree, in one run (issue 11).
#
#   bash benchmarks/lanes_side_by_side.sh OLD_TREE [LANES...]
#
# OLD_TREE is a checkout of the code to compare with (e.g. `git worktree add /tmp/old
# <commit>`); its deploy/bench_cmd.py needs the --direct flag (copy this tree's). Both
# run `benchmarks/allreduce.py --direct` (no emulator: the lanes' own limit) with the
# same flags, alternating old and new REPEATS times; tables go to stdout, JSON to $OUT.
# MIB, CODECS, REPEATS and CONNECTIONS override the defaults.
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
common=(--direct --sites 2 --rtt-ms 1 --gbit 10 --mib "${MIB:-256}" --chunk-kib 4096
        --codec "${CODECS:-raw,int8}" --connections "${CONNECTIONS:-2}" --no-throughput)
for r in $(seq "${REPEATS:-2}"); do
  for n in "${lanes[@]}"; do
    echo "== old, $n lane(s) per site, repeat $r"
    PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/allreduce.py "${common[@]}" --lanes "$n" \
      --json "$out/old-lanes$n-r$r.json"
    echo "== new, $n lane(s) per site, repeat $r"
    python3 benchmarks/allreduce.py "${common[@]}" --lanes "$n" --json "$out/new-lanes$n-r$r.json"
  done
done
