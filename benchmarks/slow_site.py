"""A site that slows while the job runs, with and without the balancer (issue 15).

Runs one `isthmus local` job twice, a site slowed FACTOR times from step SLOW_AT on
(`--slow`), first with the split of train.accumulate kept, then re-balanced every
BALANCE steps (train.balance_every). For each it prints the step time and tokens/s
before the slowdown and once the balancer has acted (from the first decision after
the slowdown plus one step), and each site's micro-batches at the end. What a
balancer can hold: the sites' summed speed drops from 2 to 1 + 1/FACTOR of a site's
(two equal sites), so the best step after the slowdown is (1 + 1/FACTOR) / 2 of the
throughput before; without balancing the slow site sets the pace alone (1/FACTOR).

    python3 benchmarks/slow_site.py --sizes 2,2 --out runs/slow --steps 24 \\
        --set model.preset=1b --set train.seq_len=2048 --set train.batch_size=4 \\
        --set train.accumulate=8 --set parallel.activation_checkpoint=true \\
        --set sync.codec=int8 --set topology.device=cuda

Writes OUT/slow_site.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _common import add_run_arguments, parser, stamped, write_json
from unequal_sites import run_once


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--sizes", default="1,1", help="ranks of each site, comma separated")
    p.add_argument("--out", required=True, type=Path, help="run directories and the JSON")
    p.add_argument("--steps", type=int, default=24, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out")
    p.add_argument("--slow-site", default="site1", help="the site that slows")
    p.add_argument("--factor", type=float, default=2.0, help="how many times slower")
    p.add_argument("--slow-at", type=int, default=8, help="the step it slows at")
    p.add_argument("--balance", type=int, default=4, help="train.balance_every of run two")
    add_run_arguments(
        p, "slow_site", 900, "passed to both runs (model, batch, accumulate, link, codec, device)"
    )
    return p.parse_args(argv)


def _records(run: Path, site: str) -> list[dict]:
    lines = (run / "sites" / site / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _window(records: list[dict], first: int, last: int) -> dict:
    """Step time and tokens/s (all sites) over steps ``first``..``last`` of site0's
    records: every site steps together with per-step sync. Digests and held-out
    evaluations are left out, as in the summary's steady state (a 1b digest takes
    seconds, and they fall where run.digest_every says)."""
    steps = [r for r in records if first <= r["step"] <= last]
    if len(steps) < 2:
        return {"steps": len(steps), "step_s": None, "tokens_per_s": None}
    checks = sum(r.get("digest_s", 0.0) + r.get("eval_s", 0.0) for r in steps[1:])
    seconds = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"] - checks
    count = len(steps) - 1
    return {"steps": count, "step_s": seconds / count, "first": first, "last": last}


def measure(run: Path, sites: list[str], args: argparse.Namespace, balance: int) -> dict:
    """The run's windows before the slowdown and after the balancer's first decision."""
    records = {s: _records(run, s) for s in sites}
    # A decision at a due step d (balance_every divides d + 1) weighs the steps since the
    # last one, d - balance + 1 .. d - 1: the first whose steps are all slowed is what
    # the balancer answers the slowdown with. Count from the step after it.
    due = args.slow_at
    if balance:
        due += balance - 1
        due += (-(due + 1)) % balance
    settled = due + 1
    before = _window(records[sites[0]], args.warmup, args.slow_at - 1)
    after = _window(records[sites[0]], settled, args.steps - 1)
    tokens = {s: {r["step"]: r["tokens"] for r in records[s]} for s in sites}
    for window in (before, after):
        if window["step_s"] is not None:
            steps = range(window["first"] + 1, window["last"] + 1)
            per_step = sum(tokens[s][k] for s in sites for k in steps) / len(steps)
            window["tokens_per_s"] = per_step / window["step_s"]
    return {
        "before": before,
        "after": after,
        "micro_batches_end": {s: records[s][-1]["micro_batches"] for s in sites},
        "micro_batches": {s: [r["micro_batches"] for r in records[s]] for s in sites},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.sizes
    sites = [f"site{i}" for i in range(len(sizes.split(",")))]
    if args.slow_site not in sites or args.factor < 1 or not 0 < args.slow_at < args.steps:
        print("error: --slow-site must name a site, --factor >= 1, 0 < --slow-at < --steps",
              file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    slow = ("--slow", f"{args.slow_site}={args.factor}@{args.slow_at}")
    rows = {}
    for name, balance in (("kept", 0), ("balanced", args.balance)):
        runs = args.overrides
        args.overrides = [*runs, f"train.balance_every={balance}"]
        summary = run_once(args, name, sizes, {}, slow)
        args.overrides = runs
        rows[name] = {
            **measure(args.out / name, sites, args, balance),
            "replicas_identical": len(set(summary["digests"].values())) == 1,
        }
    best = (1 + 1 / args.factor) / 2  # two equal sites
    print(f"{args.slow_site} {args.factor:g}x slower from step {args.slow_at}; sites {sizes}")
    print(f"{'run':<10} {'before s':>9} {'tok/s':>11} {'after s':>9} {'tok/s':>11} "
          f"{'kept %':>7} {'end split':>12}")  # fmt: skip
    for name, row in rows.items():
        b, a = row["before"], row["after"]
        kept = a["tokens_per_s"] / b["tokens_per_s"]
        row["throughput_kept"] = kept
        split = ",".join(str(m) for m in row["micro_batches_end"].values())
        print(f"{name:<10} {b['step_s']:>9.3f} {b['tokens_per_s']:>11,.0f} {a['step_s']:>9.3f} "
              f"{a['tokens_per_s']:>11,.0f} {100 * kept:>6.1f}% {split:>12}")  # fmt: skip
    print(f"compute alone, two equal sites: at best {100 * best:.1f} % of the throughput "
          f"before, {100 / args.factor:.1f} % with the split kept (an exposed sync, the "
          "same in every step, lifts both)")  # fmt: skip
    result = {
        "sizes": sizes,
        "steps": args.steps,
        "slow": {"site": args.slow_site, "factor": args.factor, "at_step": args.slow_at},
        "balance_every": args.balance,
        "overrides": args.overrides,
        "best_possible": best,
        "runs": rows,
    }
    write_json(args.json or args.out / "slow_site.json", stamped(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
