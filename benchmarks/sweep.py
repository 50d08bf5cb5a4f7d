"""Run many `isthmus local` jobs at once and tabulate what each ended with.

A plan is a JSON file: ``{"common": [ARGS...], "jobs": [{"name": ..., "args": [...],
"gpus": "0,1", "common": false}, ...]}``. Each job runs ``isthmus local COMMON ARGS
--run-dir OUT/NAME`` (``"common": false`` leaves the plan's common arguments out),
with ``CUDA_VISIBLE_DEVICES`` set to its ``gpus`` where given; up to --parallel jobs
run at the same time. Losses do not depend on what else runs on the machine, timings
do: a sweep is for losses (learning rates, sync modes, codecs), not for throughput.

Prints one row per job -- held-out loss (the last measured, and at --at-step if given),
the mean training loss over the last --tail steps, bytes across sites per token, wall
seconds -- with each job's held-out loss relative to the plan's first job (or
--baseline NAME), and writes OUT/sweep.json. A job whose summary.json exists is not
run again, so a sweep cut off by a time limit resumes where it stopped.

    python3 benchmarks/sweep.py --plan benchmarks/plans/outer_quality.json --out runs/q
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import parser

from isthmus.deploy.commands.arguments import add_set_argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--plan", required=True, type=Path, help="the plan (JSON)")
    p.add_argument("--out", required=True, type=Path, help="run directories and sweep.json")
    p.add_argument("--parallel", type=int, default=4, help="jobs at once")
    p.add_argument("--only", default="", help="comma-separated job names to run (default all)")
    p.add_argument("--baseline", default="", help="the job others are compared with")
    p.add_argument("--tail", type=int, default=20, help="steps the training loss averages")
    p.add_argument("--at-step", type=int, default=0, help="also the held-out loss at this step")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one job may take")
    add_set_argument(p, help="to every job")
    p.add_argument(
        "--report-only", action="store_true", help="tabulate the finished jobs, run none"
    )
    args = p.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    names = [job["name"] for job in plan["jobs"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: {args.plan}: job names repeat: {names}")
    if args.baseline and args.baseline not in names:
        raise SystemExit(f"error: --baseline {args.baseline!r} is not a job of {args.plan}")
    args.plan_data = plan
    return args


def command(plan: dict, job: dict, run_dir: Path, overrides: list[str]) -> list[str]:
    common = plan.get("common", []) if job.get("common", True) else []
    cmd = [sys.executable, "-m", "isthmus.deploy.cli", "local", *common, *job["args"]]
    for override in overrides:
        cmd += ["--set", override]
    return [*cmd, "--run-dir", str(run_dir)]


def run_job(args: argparse.Namespace, job: dict) -> dict:
    run_dir = args.out / job["name"]
    cmd = command(args.plan_data, job, run_dir, args.overrides)
    if not (run_dir / "summary.json").exists():
        if args.report_only:
            return {"name": job["name"], "failed": "not run", "command": cmd[3:]}
        env = dict(os.environ)
        if job.get("gpus") is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(job["gpus"])
        print(f"[{job['name']}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, env=env, check=False
        )
        took = time.monotonic() - started
        if done.returncode != 0:
            print(f"[{job['name']}] FAILED ({done.returncode}) after {took:.0f}s: "
                  f"{done.stderr[-1500:]}", file=sys.stderr, flush=True)  # fmt: skip
            return {"name": job["name"], "failed": done.stderr[-1500:], "command": cmd[3:]}
        print(f"[{job['name']}] done in {took:.0f}s", file=sys.stderr, flush=True)
    return {"name": job["name"], "command": cmd[3:], **measure(run_dir, args.tail, args.at_step)}


def measure(run_dir: Path, tail: int, at_step: int) -> dict:
    """What one finished run ended with (its merged metrics.jsonl and summary.json)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps[-tail:]]
    held_out = {r["step"] + 1: r["val_loss"] for r in steps if "val_loss" in r}
    return {
        "sync_mode": summary["sync_mode"],
        "codec": summary["codec"],
        "sites": summary["sites"],
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "val_loss": summary.get("val_loss"),
        "val_loss_at_step": held_out.get(at_step) if at_step else None,
        "val_curve": held_out,
        "train_loss_tail": sum(losses) / len(losses) if losses else None,
        "bytes_per_token": summary.get("bytes_per_token", 0.0),
        "train_s": summary["train_s"],
        "replicas_identical": len(set(summary["digests"].values())) == 1,
        "val_equal_at_every_site": not summary.get("val_unequal_steps"),
    }


def table(rows: list[dict], baseline: str, at_step: int) -> str:
    ok = [r for r in rows if "failed" not in r]
    base = next((r for r in ok if r["name"] == baseline), ok[0] if ok else None)
    key = "val_loss_at_step" if at_step else "val_loss"
    head = (
        f"{'job':<28} {'mode':<9} {'codec':<18} {'steps':>5} {'held-out':>9} {'vs base':>8} "
        f"{'train(tail)':>11} {'bytes/token':>11} {'wall s':>7} {'identical':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['name']:<28} FAILED")
            continue
        value, ref = r[key], base and base[key]
        gap = f"{value / ref - 1:+.2%}" if value is not None and ref else "-"
        lines.append(
            f"{r['name']:<28} {r['sync_mode']:<9} {r['codec']:<18} {r['steps']:>5} "
            f"{'-' if value is None else f'{value:.4f}':>9} {gap:>8} "
            f"{r['train_loss_tail']:>11.4f} {r['bytes_per_token']:>11.1f} {r['train_s']:>7.0f} "
            f"{str(r['replicas_identical']):>9}"
        )
    lines.append(f"held-out: {'at step ' + str(at_step) if at_step else 'after the last step'}; "
                 f"vs base: against {base['name'] if base else '-'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = args.plan_data["jobs"]
    if args.only:
        wanted = set(args.only.split(","))
        jobs = [j for j in jobs if j["name"] in wanted]
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        rows = list(pool.map(lambda job: run_job(args, job), jobs))
    text = table(rows, args.baseline, args.at_step)
    print(text)
    out = args.out / "sweep.json"
    out.write_text(
        json.dumps(
            {
                "plan": str(args.plan),
                "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                "machine": f"{platform.node()} {platform.machine()}",
                "date": time.strftime("%Y-%m-%d"),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
