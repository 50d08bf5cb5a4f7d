"""How much a launch costs: ranks forked from the zygote against ranks started anew.

Runs ``isthmus local`` (a short job) with ``ISTHMUS_FORK_RANKS=1`` (the default: every
rank forked from one zygote that imported the rank program once) and ``=0`` (each rank
an interpreter of its own), alternating, and prints for each run its wall time and the
CPU seconds of all its processes (the launcher, the zygote and the ranks: every one is
waited for in turn, so their usage reaches this process's children's).

    python3 benchmarks/rank_start.py [--repeats 3] [--steps 2] [--json out.json] [-- ISTHMUS LOCAL FLAGS]

With no flags after ``--``, the README's job (2 sites x 2 ranks, the default model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(fork: bool, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="rank-start-") as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "isthmus.deploy.cli", "local", "--steps", str(steps)]
        argv += ["--run-dir", str(run_dir), "--quiet", *extra]
        env = {**os.environ, "ISTHMUS_FORK_RANKS": "1" if fork else "0"}
        cpu, started = _children_cpu_s(), time.monotonic()
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        wall, cpu = time.monotonic() - started, _children_cpu_s() - cpu
        if result.returncode != 0:
            raise SystemExit(f"isthmus local failed:\n{result.stderr[-2000:]}")
        job = json.loads((run_dir / "job.json").read_text())
    return {
        "forked": fork,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "ranks": len(job["ranks"]),
        "parents": len({r["parent_pid"] for r in job["ranks"]}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs, alternating")
    parser.add_argument("--steps", type=int, default=2, help="steps of each run")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    parser.add_argument("extra", nargs="*", help="more `isthmus local` flags (after --)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    runs = []
    print(f"{'run':>4} {'ranks':>8} {'wall s':>8} {'CPU s':>8}")
    for r in range(args.repeats):
        for fork in (True, False):
            run = one_run(fork, args.steps, args.extra)
            runs.append(run)
            how = "forked" if fork else "own"
            print(f"{r + 1:>4} {how:>8} {run['wall_s']:>8.1f} {run['cpu_s']:>8.1f}", flush=True)
    for fork in (True, False):
        mine = [x for x in runs if x["forked"] == fork]
        print(
            f"{'median':>4} {'forked' if fork else 'own':>8} "
            f"{statistics.median(x['wall_s'] for x in mine):>8.1f} "
            f"{statistics.median(x['cpu_s'] for x in mine):>8.1f}"
        )
    if args.json is not None:
        write_json(
            args.json,
            {
                "date": datetime.date.today().isoformat(),
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "steps": args.steps,
                "extra": args.extra,
                "runs": runs,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
