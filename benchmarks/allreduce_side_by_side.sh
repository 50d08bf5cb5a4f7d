#!/usr/bin/env bash
# One `benchmarks/allreduce.py` case, old code against this tree, alternating in one run.
#
#   bash benchmarks/allreduce_side_by_side.sh OLD_TREE NAME [ALLREDUCE FLAGS...]
#
# OLD_TREE is a copy of the package folders to compare with (e.g. `git archive COMMIT
# inter intra sim deploy proto | tar -x -C /tmp/old`); it is imported as `isthmus`
# through a shim, as benchmarks/lanes_side_by_side.sh does (a namespace package: a
# subpackage the old tree lacks comes from the installed tree). The flags go to both trees
# unchanged (the old tree must know each of them). PAIRS (default 2) old/new pairs run,
# old first; each prints its table row, and writes $OUT/NAME-old-N.json and
# $OUT/NAME-new-N.json (OUT defaults to side-by-side-results). Compare the pairs of one
# run: single rounds on a shared host vary by up to 13 points (docs/benchmarks/lanes.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
old=${1:?usage: $0 OLD_TREE NAME [ALLREDUCE FLAGS...]}
name=${2:?usage: $0 OLD_TREE NAME [ALLREDUCE FLAGS...]}
shift 2
out=${OUT:-side-by-side-results}
mkdir -p "$out"
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$(cd "$old" && pwd)" "$shim/isthmus" # the old tree imported as `isthmus`
for r in $(seq "${PAIRS:-2}"); do
  for tree in old new; do
    echo "== $name, $tree, pair $r"
    path=${PYTHONPATH:-}
    [ "$tree" = old ] && path="$shim${path:+:$path}"
    PYTHONPATH="$path" python3 benchmarks/allreduce.py "$@" --json "$out/$name-$tree-$r.json" |
      grep -E '^ +[0-9]+ ' || echo "   (no table row: see above)"
  done
done
