#!/usr/bin/env bash
# The GPU measurements recorded in docs/benchmarks/, in two parts that each fit
# one 10-minute device call on a 4-GPU host (8 GPUs: set SITE_GPUS=4).
#   bash benchmarks/gpu_runs.sh sync    # issue 4: cross-site all-reduce acceptance
#                                        # issue 3: one 4-GPU site at the 1b preset
#   bash benchmarks/gpu_runs.sh sites   # issue 3: one site vs two sites, 1b preset
#   bash benchmarks/gpu_runs.sh headline  # issue 11: scaling efficiency against the
#                                          # per-GPU batch, int8 over 1000 km at 10 Gbit/s
#   bash benchmarks/gpu_runs.sh raw       # the same with the fp32 raw codec
#   bash benchmarks/gpu_runs.sh modes     # issue 12: per-step sync against DiLoCo and
#                                          # overlapped DiLoCo over 1000 km at 1 Gbit/s
#                                          # (PRESET, default 125m; STEPS, default 100)
#                                          # (STEADY_AFTER: steps left out of the
#                                          # steady state, default 2; CODEC, default int8)
#   bash benchmarks/gpu_runs.sh loss      # per-step sync's loss over STEPS steps on a
#                                          # 10 Gbit/s link: the baseline the modes'
#                                          # loss compares with (a link changes no loss)
#   bash benchmarks/gpu_runs.sh corpus    # a larger corpus for long loss comparisons:
#                                          # the host's installed source files
#   bash benchmarks/gpu_runs.sh pair      # one site alone against two one-site jobs
#                                          # at once on the two halves of the host
#   bash benchmarks/gpu_runs.sh longctx   # issue 17: one site of all GPUs, 125m at
#                                          # SEQ tokens (default 262144), one sequence
#                                          # per replica: cp = 1 (dp = GPUs) against
#                                          # cp = GPUs, without and with activation
#                                          # checkpointing: tokens/s, MFU, peak memory
#                                          # (CHECKPOINTING="off" runs without only)
#   bash benchmarks/gpu_runs.sh moe       # issue 17: moe-125m with ep = GPUs against
#                                          # dense 125m (equal active parameters):
#                                          # tokens/s, MFU, time in collectives
#   bash benchmarks/gpu_runs.sh cp-sites  # issue 17: one site against two sites with
#                                          # cp = SITE_GPUS inside each, 125m at 32k
#                                          # tokens, int8 over 1000 km at 10 Gbit/s
#   bash benchmarks/gpu_runs.sh ep-sites  # the same with moe-125m, ep = SITE_GPUS
#   bash benchmarks/gpu_runs.sh dense-sites  # ep-sites' job with the dense 125m (equal
#                                          # active parameters): issue 36's baseline
#   bash benchmarks/gpu_runs.sh slow      # issue 15: sites of SIZES GPUs (default 2,2),
#                                          # site1 2x slower from step 8 of 24, the split
#                                          # kept and re-balanced every 4 steps; 1b,
#                                          # batch 8 x 8 micro-batches x 2048 per GPU
#   bash benchmarks/gpu_runs.sh unequal   # issue 15: sites of SIZES GPUs (default
#                                          # 2,1) alone and together, 1b, batch BATCH
#                                          # (64) x 2048, int8 over 1000 km at 10 Gbit/s
# Results go to $OUT (default ./gpu-results).
# headline and raw run benchmarks/scaling_curve.py: for each per-GPU batch in BATCHES
# (default "32 64", x 2048 tokens, with activation checkpointing so that they fit; at
# 64 one site's backward outlasts the link's 0.82 s for the int8 gradient, the
# headline's point: 94.1 % measured) one site of SITE_GPUS GPUs, then two such sites,
# STEPS steps each (default 12; the first WARMUP, default 3, are left out of the steady
# state), and print one site's and two sites' tokens/s, the scaling efficiency, the
# exposed sync per step and the planning model's prediction; OUT/<mode>.json holds it
# all, OUT/<mode>.txt the table. The runs' own directories go to RUNS (default
# /tmp/isthmus-runs/<mode>), where finished runs are not run again. About a minute or
# two per run (start-up and compilation dominate): to stay inside one 10-minute call,
# split a curve (BATCHES="4 8", then BATCHES="16"). EXTRA replaces the default extra
# --set options of every run ("--set parallel.activation_checkpoint=true"); EXTRA=" "
# runs without checkpointing (small batches are faster so).
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
            --set topology.device=cuda --set sync.mode=step)
    python3 -m isthmus.deploy.cli local --sites 1 --ranks-per-site "$site_gpus" \
      "${common[@]}" --run-dir /tmp/one-site | tee "$out/one_site.txt"
    cp /tmp/one-site/summary.json "$out/one_site.json"
    python3 -m isthmus.deploy.cli local --sites 2 --ranks-per-site "$site_gpus" \
      "${common[@]}" --run-dir /tmp/two-sites | tee "$out/two_sites.txt"
    cp /tmp/two-sites/summary.json "$out/two_sites.json"
    ;;
  headline|raw)
    codec=int8
    [ "$1" = raw ] && codec=raw
    batches=${BATCHES:-32 64}
    # shellcheck disable=SC2206  # EXTRA is split into words on purpose
    extra=(${EXTRA:---set parallel.activation_checkpoint=true})
    python3 benchmarks/scaling_curve.py --out "${RUNS:-/tmp/isthmus-runs}/$1" \
      --json "$out/$1.json" --batches "${batches// /,}" \
      --preset 1b --seq 2048 --sites 2 --ranks-per-site "$site_gpus" --codec "$codec" \
      --steps "${STEPS:-12}" --warmup "${WARMUP:-3}" \
      --set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 \
      --set topology.device=cuda "${extra[@]}" | tee "$out/$1.txt"
    ;;
  modes)
    # One site alone (for the scaling efficiency; ONE_SITE=0: none, ONE_SITE_STEPS: its
    # length), then two sites per mode; the per-step baseline runs 20 steps only (each
    # waits on the link); `joined` (all GPUs in one site) is the loss baseline of long
    # runs. EVAL_EVERY: held-out loss every this many steps; EXTRA: more --set options.
    preset=${PRESET:-125m}
    steps=${STEPS:-100}
    one=()
    [ "${ONE_SITE:-1}" = 1 ] && one=(--one-site --one-site-steps "${ONE_SITE_STEPS:-$steps}")
    # shellcheck disable=SC2206  # EXTRA is split into words on purpose
    extra=(${EXTRA:-})
    python3 benchmarks/sync_modes.py --out "${RUNS:-/tmp/isthmus-runs}/modes-$preset" \
      --json "$out/modes_$preset.json" "${one[@]}" --preset "$preset" \
      --ranks-per-site "$site_gpus" --steps "$steps" --tail 10 --codec "${CODEC:-int8}" \
      --modes "${MODES:-step@20,diloco:20,diloco:20:19}" --timeout "${RUN_TIMEOUT:-400}" \
      --steady-after "${STEADY_AFTER:-2}" --eval-every "${EVAL_EVERY:-50}" \
      --set topology.device=cuda --set train.seq_len=2048 \
      --set train.batch_size="${BATCH:-16}" --set wan.distance_km=1000 \
      --set wan.bandwidth_mbit=1000 "${extra[@]}" | tee "$out/modes_$preset.txt"
    ;;
  corpus)
    # A corpus larger than the default one (the standard library's 30-odd MB, which the
    # 125m model memorizes within a few thousand steps of 2 x 2 GPUs): the source text
    # of the host's installed packages, sorted by path, up to CORPUS_BYTES (default
    # 600 MB), written to CORPUS (default /tmp/corpus.txt). Train on it with
    # EXTRA="--set data.source=path --set data.path=/tmp/corpus.txt --set data.max_bytes=..."
    corpus=${CORPUS:-/tmp/corpus.txt}
    read -r -a roots < <(python3 -c 'import site, sys; print(sys.prefix, *site.getsitepackages())')
    find /usr /opt "${roots[@]}" -type f -size -1024k \( -name '*.py' -o -name '*.h' \
      -o -name '*.hpp' -o -name '*.cuh' -o -name '*.c' -o -name '*.cc' -o -name '*.cpp' \) \
      -print0 2>/dev/null | sort -zu | xargs -0 cat 2>/dev/null \
      | head -c "${CORPUS_BYTES:-600000000}" >"$corpus" || true
    echo "corpus: $(stat -c %s "$corpus") bytes in $corpus" | tee "$out/corpus.txt"
    ;;
  loss)
    preset=${PRESET:-125m}
    python3 benchmarks/sync_modes.py --out "${RUNS:-/tmp/isthmus-runs}/loss-$preset" \
      --json "$out/loss_$preset.json" --preset "$preset" \
      --ranks-per-site "$site_gpus" --steps "${STEPS:-600}" --tail 10 --codec int8 \
      --modes step --timeout 500 \
      --set topology.device=cuda --set train.seq_len=2048 \
      --set train.batch_size="${BATCH:-16}" --set wan.distance_km=1000 \
      --set wan.bandwidth_mbit=10000 | tee "$out/loss_$preset.txt"
    ;;
  longctx)
    # Without checkpointing, one 125m sequence of 131k tokens takes 68 GiB of an H100
    # and one of 262k does not fit: context parallelism is what makes it fit. With
    # checkpointing both fit, and data parallelism (cp = 1) is the faster of the two.
    seq=${SEQ:-262144}
    for ac in ${CHECKPOINTING:-off on}; do
      for cp in 1 "$gpus"; do
        name=longctx_cp$cp
        flags=()
        if [ "$ac" = on ]; then name=${name}_ac; flags=(--ac); fi
        timeout "${RUN_TIMEOUT:-240}" python3 -m torch.distributed.run \
          --nproc-per-node "$gpus" benchmarks/site_step.py --preset 125m --seq "$seq" \
          --batch 1 --cp "$cp" "${flags[@]}" --warmup 2 --steps 4 --profile-steps 0 \
          --json "$out/$name.json" >"$out/$name.log" 2>&1 \
          || echo "cp=$cp checkpointing=$ac: failed, $(grep -o 'OutOfMemoryError' "$out/$name.log" | head -1)"
        tail -8 "$out/$name.log" | tee "$out/$name.txt"
      done
    done
    ;;
  moe)
    for preset in 125m moe-125m; do
      ep=1; [ "$preset" = moe-125m ] && ep=$gpus
      timeout "${RUN_TIMEOUT:-240}" python3 -m torch.distributed.run \
        --nproc-per-node "$gpus" benchmarks/site_step.py \
        --preset "$preset" --ep "$ep" --batch 8 --seq 2048 --warmup 3 --steps 10 \
        --json "$out/moe_$preset.json" >"$out/moe_$preset.log" 2>&1 || echo "$preset: failed"
      tail -12 "$out/moe_$preset.log" | tee "$out/moe_$preset.txt"
    done
    ;;
  cp-sites|ep-sites|dense-sites)
    # Per-step int8 sync over 1000 km at 10 Gbit/s (the issue-11 headline's link);
    # eager (parallel.compile=false): the comparison is one site against two.
    if [ "$1" = cp-sites ]; then
      shape=(--preset 125m --seq "${SEQ:-32768}" --batches "${BATCHES:-1}"
             --set "topology.cp=$site_gpus")
    elif [ "$1" = ep-sites ]; then
      shape=(--preset moe-125m --seq 2048 --batches "${BATCHES:-16}"
             --set "topology.ep=$site_gpus" --set parallel.activation_checkpoint=true)
    else
      shape=(--preset 125m --seq 2048 --batches "${BATCHES:-16}"
             --set parallel.activation_checkpoint=true)
    fi
    python3 benchmarks/scaling_curve.py --out "${RUNS:-/tmp/isthmus-runs}/$1" \
      --json "$out/$1.json" "${shape[@]}" --sites 2 --ranks-per-site "$site_gpus" \
      --codec int8 --steps "${STEPS:-16}" --warmup "${WARMUP:-4}" \
      --set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 \
      --set topology.device=cuda --set parallel.compile=false | tee "$out/$1.txt"
    ;;
  unequal)
    python3 benchmarks/unequal_sites.py --sizes "${SIZES:-2,1}" \
      --out "${RUNS:-/tmp/isthmus-runs}/unequal" --json "$out/unequal.json" \
      --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --set model.preset="${PRESET:-1b}" \
      --set train.seq_len=2048 --set train.batch_size="${BATCH:-64}" \
      --set parallel.activation_checkpoint=true --set sync.codec=int8 \
      --set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 \
      --set topology.device=cuda | tee "$out/unequal.txt"
    ;;
  slow)
    python3 benchmarks/slow_site.py --sizes "${SIZES:-2,2}" \
      --out "${RUNS:-/tmp/isthmus-runs}/slow" --json "$out/slow.json" \
      --steps "${STEPS:-24}" --slow-at "${SLOW_AT:-8}" --factor "${FACTOR:-2}" \
      --balance "${BALANCE:-4}" --set model.preset="${PRESET:-1b}" \
      --set train.seq_len=2048 --set train.batch_size="${BATCH:-8}" \
      --set train.accumulate="${ACCUMULATE:-8}" \
      --set parallel.activation_checkpoint=true --set sync.codec=int8 \
      --set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 \
      --set topology.device=cuda | tee "$out/slow.txt"
    ;;
  pair)
    # Do two sites on one host slow each other with nothing crossing between them?
    # One site alone, then two one-site jobs at once on the two halves of the GPUs.
    preset=${PRESET:-125m}
    common=(--sites 1 --ranks-per-site "$site_gpus" --steps "${STEPS:-300}" --quiet
            --set model.preset="$preset" --set topology.device=cuda --set train.seq_len=2048
            --set train.batch_size="${BATCH:-16}" --set run.tensorboard=false)
    python3 -m isthmus.deploy.cli local "${common[@]}" --run-dir /tmp/pair-alone >/dev/null
    first=$(seq -s, 0 $((site_gpus - 1)))
    second=$(seq -s, "$site_gpus" $((2 * site_gpus - 1)))
    CUDA_VISIBLE_DEVICES=$first python3 -m isthmus.deploy.cli local "${common[@]}" \
      --run-dir /tmp/pair-a >/dev/null &
    CUDA_VISIBLE_DEVICES=$second python3 -m isthmus.deploy.cli local "${common[@]}" \
      --run-dir /tmp/pair-b >/dev/null
    wait
    for run in alone a b; do
      python3 -c "import json, sys; s = json.load(open(sys.argv[1]))
print(sys.argv[2], round(s['steady_tokens_per_s']), 'tokens/s')" \
        "/tmp/pair-$run/summary.json" "$run"
    done | tee "$out/pair_$preset.txt"
    ;;
  *)
    echo "usage: $0 sync|sites|headline|raw|modes|loss|longctx|moe|cp-sites|ep-sites|dense-sites|unequal|slow|pair" >&2
    exit 2
    ;;
esac
