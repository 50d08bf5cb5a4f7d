"""Does the script API cost anything? The same job through the built-in trainer and
through `examples/preset.py` (the built-in model trained by a user script on
`isthmus.deploy.api`), alternated in one run; prints a table, writes JSON.

Issue 34 asks for tokens/s within 2 % (the 125m preset on a GPU, and on the CPU):

    python3 benchmarks/api_cost.py --out /tmp/api --pairs 3 --steps 12 \\
        --set model.preset=125m                      # a GPU host: `isthmus local` fits it
    python3 benchmarks/api_cost.py --out /tmp/api --pairs 3 --steps 12 \\
        --set model.preset=tiny --set topology.device=cpu

Each pair runs trainer then script (the order alternates between pairs, so a machine
that warms up or slows down over the run weighs on both); the figure of each is the
median over pairs of the run's ``steady_tokens_per_s`` (summary.json: the last steps
after ``run.steady_after``). The trainer's held-out loss is off (``run.eval_every=0``):
the script measures none. Every run keeps its directory under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "preset.py"
WAYS = ("trainer", "script")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="run directories and the JSON")
    p.add_argument("--pairs", type=int, default=3, help="trainer/script pairs (default 3)")
    p.add_argument("--steps", type=int, default=12, help="steps a run (default 12)")
    p.add_argument("--warmup", type=int, default=4, help="run.steady_after (default 4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="a config override for both ways (repeatable)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run (default 900)")
    p.add_argument("--json", type=Path, default=None, help="default OUT/api_cost.json")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps <= args.warmup:
        p.error("--pairs must be >= 1 and --steps more than --warmup")
    return args


def run(args: argparse.Namespace, way: str, pair: int) -> dict:
    """One `isthmus local` run of ``way``; its summary's figures."""
    where = args.out / f"{way}-{pair}"
    cmd = [sys.executable, "-m", "isthmus.deploy.cli", "local", "--quiet", "--run-dir", str(where)]
    cmd += ["--steps", str(args.steps), "--set", f"run.steady_after={args.warmup}"]
    # The script measures no held-out loss, so neither does the trainer here.
    cmd += ["--set", "run.eval_every=0"]
    cmd += [x for s in args.overrides for x in ("--set", s)]
    if way == "script":
        cmd += ["--script", str(SCRIPT)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{way} run {pair} failed ({done.returncode}): " + " | ".join(tail))
    summary = json.loads((where / "summary.json").read_text())
    return {
        "way": way,
        "pair": pair,
        "wall_s": time.monotonic() - started,
        "steady_tokens_per_s": summary["steady_tokens_per_s"],
        "steady_step_s": summary.get("steady_step_s"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for pair in range(args.pairs):
        for way in WAYS if pair % 2 == 0 else WAYS[::-1]:
            runs.append(run(args, way, pair))
            r = runs[-1]
            print(f"pair {pair} {way:8} {r['steady_tokens_per_s']:>12,.0f} tok/s", flush=True)
    median = {
        w: statistics.median(r["steady_tokens_per_s"] for r in runs if r["way"] == w) for w in WAYS
    }
    ratio = median["script"] / median["trainer"]
    print(f"\n{'way':8} {'tokens/s (median)':>18}")
    for w in WAYS:
        print(f"{w:8} {median[w]:>18,.0f}")
    print(f"script / trainer: {ratio:.3f} ({(ratio - 1) * 100:+.1f} %)")
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()})",
        "command": " ".join(sys.argv),
        "median_tokens_per_s": median,
        "script_over_trainer": ratio,
        "runs": runs,
    }
    path = args.json or args.out / "api_cost.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
