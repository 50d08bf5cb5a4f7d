"""The same multi-site job run N times: does it finish cleanly every time?

Issue 38: the 1b per-step headline (int8 over 1000 km at 10 Gbit/s, 2 sites x 1 GPU)
stalled 120 s in 2 of 4 runs on a chunk that left a finite gradient and arrived as
NaN. This runs the job ``--repeats`` times, each into its own run directory, and for
each run reads what the sites recorded (sites/<site>/metrics.jsonl, summary.json, the
ranks' logs) and prints one row: whether it finished, its steady step time, the
slowest step, retries, refused (non-finite) and corrupt chunks, the log lines that
mention NaN or a timeout, and whether the replicas ended identical. ``--one-site``
also runs the job once with one site, for the loss of the first steps next to the
two sites' (the issue asked whether the loss jump at steps 0-4 is the sync's).
With it, each run's scaling efficiency against that one site and their median
are printed too (issue 32's headline is a median of 3).

    python3 benchmarks/repeat_runs.py --out /tmp/repeat --repeats 10 \\
        --preset 1b --seq 2048 --batch 64 --codec int8 --steps 24 --warmup 6 \\
        --set wan.distance_km=1000 --set wan.bandwidth_mbit=10000 \\
        --set topology.device=cuda --set parallel.activation_checkpoint=true

A run whose summary.json exists is not run again, so the repeats can be spread over
several calls (``--repeats`` counts them all). Writes OUT/repeat_runs.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import parser, write_json
from scaling_curve import run_args  # the same `isthmus local` arguments as the curve
from sync_modes import site_records, tokens_per_s_before_last

from isthmus.deploy.commands.arguments import add_set_argument

_ALARM = re.compile(r"NaN or Inf|timed out|non-finite|gave the round up")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, "run directories and the JSON go here")
    p.add_argument("--repeats", type=int, default=10, help="runs of the multi-site job")
    p.add_argument("--sites", type=int, default=2, help="sites of the job")
    p.add_argument("--ranks-per-site", type=int, default=1, help="ranks (GPUs) per site")
    p.add_argument("--preset", default="1b", help="model preset")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=64, help="sequences per rank and step")
    p.add_argument("--codec", default="int8", help="sync.codec")
    p.add_argument("--steps", type=int, default=24, help="steps per run")
    p.add_argument("--warmup", type=int, default=6, help="steps left out of the steady state")
    p.add_argument("--one-site", action="store_true", help="also run the job once, one site")
    p.add_argument(
        "--one-site-steps",
        type=int,
        help="steps of the one-site run (default --steps): its steady tokens/s is all "
        "the scaling efficiency needs, and a streaming job's steady state wants long runs",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--json", type=Path, help="default OUT/repeat_runs.json")
    add_set_argument(p)
    return p.parse_args(argv)


def run_once(args: argparse.Namespace, where: Path, sites: int) -> float | None:
    """One `isthmus local` run into ``where`` unless it finished before; its wall
    seconds (None when it was not run now)."""
    if (where / "summary.json").exists():
        return None
    cmd = [sys.executable, "-m", "isthmus.deploy.cli", "local", "--quiet", "--run-dir", str(where)]
    started = time.monotonic()
    try:
        result = subprocess.run(
            cmd + run_args(args, sites, args.batch),
            capture_output=True,
            text=True,
            timeout=args.timeout,
            stdin=subprocess.DEVNULL,
        )
        code = result.returncode
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
    except subprocess.TimeoutExpired:
        code, tail = -1, f"did not finish in {args.timeout:.0f} s"
    wall = time.monotonic() - started
    where.mkdir(parents=True, exist_ok=True)
    (where / "wall_s.txt").write_text(f"{wall:.1f}\n")
    if code != 0:
        (where / "failure.txt").write_text(tail + "\n")
    print(f"ran {where.name} in {wall:.0f} s (exit {code})", file=sys.stderr, flush=True)
    return wall


def records(where: Path) -> list[dict]:
    """Every site's per-step records, in step order."""
    out = []
    for path in sorted(where.glob("sites/*/metrics.jsonl")):
        site = path.parent.name
        for line in path.read_text().splitlines():
            if line.strip():
                out.append({"site": site, **json.loads(line)})
    return sorted(out, key=lambda r: (r.get("step", 0), r["site"]))


def row(where: Path) -> dict:
    """One run's figures."""
    recs = records(where)
    summary_path = where / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    alarms = []
    for log in sorted(where.glob("logs/*.log")):
        alarms += [f"{log.stem}: {line.strip()[:200]}" for line in log.read_text(errors="replace").splitlines() if _ALARM.search(line)]  # fmt: skip
    step_s: dict[int, float] = {}
    before: dict[str, float] = {}
    for r in recs:  # a step's time, from the sites' running clocks: the slowest site's
        took = r.get("elapsed_s", 0.0) - before.get(r["site"], 0.0)
        before[r["site"]] = r.get("elapsed_s", 0.0)
        step_s[r["step"]] = max(step_s.get(r["step"], 0.0), took)
    losses: dict[int, list[float]] = {}
    for r in recs:
        losses.setdefault(r["step"], []).append(r.get("loss", float("nan")))
    digests = summary.get("digests", {})
    failure = where / "failure.txt"
    return {
        "run": where.name,
        "finished": bool(summary) and not failure.exists(),
        "failure": failure.read_text().strip() if failure.exists() else "",
        "wall_s": float((where / "wall_s.txt").read_text())
        if (where / "wall_s.txt").exists()
        else None,  # fmt: skip
        "steps": len(step_s),
        "step_s": [round(step_s[k], 3) for k in sorted(step_s)],
        "max_step_s": max(step_s.values(), default=0.0),
        "steady_step_s": summary.get("steady_step_s"),
        "steady_tokens_per_s": summary.get("steady_tokens_per_s"),
        # Without the job's last step: an outer mode's last round waits for the whole
        # model once, a drain that weighs on a short run and not on a long one.
        "tokens_per_s_before_last": tokens_per_s_before_last(
            site_records(where), max(1, summary.get("steady_after", 1))
        )
        if summary
        else None,
        "max_exposed_sync_s": max((r.get("exposed_sync_s", 0.0) for r in recs), default=0.0),
        "exposed_sync_s_per_step": summary.get("exposed_sync_s_per_step"),
        "retries": sum(r.get("retries", 0) for r in recs),
        "nonfinite_chunks": sum(r.get("nonfinite_chunks", 0) for r in recs),
        "corrupt_chunks": sum(r.get("corrupt_chunks", 0) for r in recs),
        "generations": sorted({r.get("generation", 0) for r in recs}),
        "alarms": alarms[:20],
        "loss_first_steps": [round(sum(v) / len(v), 3) for _, v in sorted(losses.items())[:6]],
        "loss_last": summary.get("loss_last"),
        "replicas_identical": len(set(digests.values())) == 1 and len(digests) > 1,
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"{'run':<8} {'ok':<3} {'steps':>5} {'step s':>7} {'max s':>6} {'max exp s':>9} {'retries':>7} "
        f"{'nonfin':>6} {'corrupt':>7} {'alarms':>6} {'same':<5} loss steps 0-5"
    )
    for r in rows:
        step = f"{r['steady_step_s']:.3f}" if r["steady_step_s"] else "-"
        print(
            f"{r['run']:<8} {'yes' if r['finished'] else 'NO':<3} {r['steps']:>5} {step:>7} "
            f"{r['max_step_s']:>6.2f} "
            f"{r['max_exposed_sync_s']:>9.2f} {r['retries']:>7} {r['nonfinite_chunks']:>6} "
            f"{r['corrupt_chunks']:>7} {len(r['alarms']):>6} "
            f"{'yes' if r['replicas_identical'] else 'no':<5} {r['loss_first_steps']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.one_site:
        one = argparse.Namespace(**{**vars(args), "steps": args.one_site_steps or args.steps})
        run_once(one, args.out / "one-site", 1)
        rows.append(row(args.out / "one-site"))
    for i in range(args.repeats):
        run_once(args, args.out / f"run{i}", args.sites)
        rows.append(row(args.out / f"run{i}"))
    print_table(rows)
    multi = [r for r in rows if r["run"] != "one-site"]
    one_tps = rows[0]["steady_tokens_per_s"] if args.one_site else None
    if one_tps:  # scaling efficiency of each run against the one site, and their median
        one_before_last = rows[0]["tokens_per_s_before_last"] or one_tps
        for r in multi:
            r["efficiency"] = (r["steady_tokens_per_s"] or 0.0) / (args.sites * one_tps)
            r["efficiency_before_last"] = (r["tokens_per_s_before_last"] or 0.0) / (
                args.sites * one_before_last
            )
        for key, what in (("efficiency", ""), ("efficiency_before_last", " without the last step")):  # fmt: skip
            effs = [r[key] for r in multi]
            print(
                f"one site {one_tps:,.0f} tokens/s; scaling efficiency{what} "
                + ", ".join(f"{e:.1%}" for e in effs)
                + f"; median {statistics.median(effs):.1%}"
            )
    clean = [
        r
        for r in multi
        if r["finished"] and not r["alarms"] and r["retries"] == 0 and r["replicas_identical"]
    ]
    print(f"{len(clean)} of {len(multi)} runs clean (finished, no alarm, no retry, replicas equal)")
    result = {
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "args": run_args(args, args.sites, args.batch),
        "rows": rows,
        "clean": len(clean),
    }
    write_json(args.json or args.out / "repeat_runs.json", result)
    return 0 if len(clean) == len(multi) else 1


if __name__ == "__main__":
    sys.exit(main())
