"""Sites of different sizes against the sum of their parts (issue 15).

Runs `isthmus local` for each site alone (one site of its size, on its own devices),
then all of them as one job (`--ranks-per-site 2,1`), and prints the job's steady
tokens/s against the sum of the sites' standalone tokens/s: what a second, smaller
site adds when it joins. Each site keeps its own devices in every run (on a GPU host
site i takes the GPUs after those of the sites before it), so the standalone runs
measure the same hardware the job uses.

    python3 benchmarks/unequal_sites.py --sizes 2,1 --out runs/unequal --steps 12 \\
        --set model.preset=1b --set train.seq_len=2048 --set train.batch_size=32 \\
        --set parallel.activation_checkpoint=true --set wan.bandwidth_mbit=10000 \\
        --set wan.distance_km=1000 --set sync.codec=int8 --set topology.device=cuda

A run whose summary.json already exists under --out is not run again. Writes
OUT/unequal_sites.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import add_run_arguments, parser, stamped, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--sizes", default="2,1", help="ranks of each site, comma separated")
    p.add_argument("--out", required=True, type=Path, help="run directories and the JSON")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady state")
    add_run_arguments(
        p, "unequal_sites", 600, "passed to every run (model, batch, link, codec, device)"
    )
    return p.parse_args(argv)


def _devices(sizes: list[int], site: int) -> str:
    first = sum(sizes[:site])
    return ",".join(str(d) for d in range(first, first + sizes[site]))


def run_once(
    args: argparse.Namespace,
    name: str,
    ranks: str,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
) -> dict:
    """One `isthmus local` run (reused when its summary exists) with ``extra`` flags;
    returns its summary. ``args`` holds out, steps, warmup, overrides and timeout."""
    where = args.out / name
    summary = where / "summary.json"
    if not summary.exists():
        sites = str(len(ranks.split(",")))
        cmd = [sys.executable, "-m", "isthmus.deploy.cli", "local", "--quiet"]
        cmd += ["--run-dir", str(where), "--sites", sites, "--ranks-per-site", ranks]
        cmd += ["--steps", str(args.steps), "--set", f"run.steady_after={args.warmup}"]
        cmd += ["--set", "sync.mode=step"]  # named: the GPU quick start would fit it
        cmd += [a for o in args.overrides for a in ("--set", o)]
        cmd += list(extra)
        started = time.monotonic()
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{name} failed:\n{tail}")
        print(f"ran {name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return json.loads(summary.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sizes = [int(n) for n in args.sizes.split(",")]
    except ValueError:
        print(f"error: --sizes must be integers, got {args.sizes!r}", file=sys.stderr)
        return 2
    if len(sizes) < 2 or min(sizes) < 1:
        print(f"error: --sizes needs two or more sites of >= 1 rank, got {sizes}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    alone = []
    for i, n in enumerate(sizes):
        # A site alone on the devices it has in the job (CPU runs ignore the variable).
        env = {"CUDA_VISIBLE_DEVICES": _devices(sizes, i)}
        alone.append(run_once(args, f"site{i}-alone", str(n), env))
    job = run_once(args, "together", args.sizes, {})
    parts = [s["steady_tokens_per_s"] for s in alone]
    together = job["steady_tokens_per_s"]
    efficiency = together / sum(parts)
    replicas = len(set(job["digests"].values())) == 1
    print(f"{'run':<22} {'ranks':>6} {'tokens/s':>12} {'step s':>8}")
    for i, (n, s) in enumerate(zip(sizes, alone, strict=True)):
        print(f"{f'site{i} alone':<22} {n:>6} {s['steady_tokens_per_s']:>12,.0f} "
              f"{s['steady_step_s']:>8.3f}")  # fmt: skip
    print(f"{'sites together':<22} {args.sizes:>6} {together:>12,.0f} {job['steady_step_s']:>8.3f}")
    print(
        f"together / sum alone: {100 * efficiency:.1f} %  exposed sync "
        f"{job['exposed_sync_s_per_step']:.3f} s/step  replicas equal: {replicas}"
    )
    result = {
        "sizes": sizes,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "overrides": args.overrides,
        "alone_tokens_per_s": parts,
        "together_tokens_per_s": together,
        "efficiency": efficiency,
        "exposed_sync_s_per_step": job["exposed_sync_s_per_step"],
        "replicas_identical": replicas,
        "alone": alone,
        "together": job,
    }
    write_json(args.json or args.out / "unequal_sites.json", stamped(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
