"""Training quality and WAN bytes of each sync mode at equal tokens.

Runs `isthmus local` once per mode on the same job (same model, seed, sites, global
batch and steps, so every run sees the same tokens), then prints one row per mode:
the final training loss (mean over the sites and the last --tail steps), its gap to
the per-step run, bytes across sites per token and the wall time.

    python3 benchmarks/sync_modes.py --out runs/modes --steps 400 --preset small \\
        --modes step,diloco:20,diloco:50 --codec raw

A mode is `step` or `diloco:H` (H inner steps; outer lr and momentum from --set). A
run whose summary.json already exists under --out is not run again. Writes
OUT/sync_modes.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, type=Path, help="run directories and the JSON go here")
    p.add_argument("--modes", default="step,diloco:20,diloco:50", help="comma separated")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--preset", default="small", help="model preset")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--ranks-per-site", type=int, default=1)
    p.add_argument("--codec", default="raw", help="sync.codec of every run")
    p.add_argument("--tail", type=int, default=20, help="steps the final loss averages over")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="passed to every run",
    )
    p.add_argument("--json", type=Path, default=None, help="default OUT/sync_modes.json")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    args = p.parse_args(argv)
    for mode in args.modes.split(","):
        mode_settings(mode)  # refuse a bad mode before anything runs
    return args


def mode_settings(mode: str) -> list[str]:
    """`--set` arguments of one mode spec (`step` or `diloco:H`)."""
    name, _, h = mode.partition(":")
    if name == "step" and not h:
        return ["--set", "sync.mode=step"]
    if name == "diloco" and h.isdigit() and int(h) >= 1:
        return ["--set", "sync.mode=diloco", "--set", f"sync.inner_steps={h}"]
    raise SystemExit(f"error: mode {mode!r}: expected step or diloco:H with H >= 1")


def run_mode(args: argparse.Namespace, mode: str) -> Path:
    run_dir = args.out / mode.replace(":", "-h")
    if (run_dir / "summary.json").exists():
        return run_dir
    cmd = [
        sys.executable, "-m", "isthmus.deploy.cli", "local",
        "--sites", str(args.sites), "--ranks-per-site", str(args.ranks_per_site),
        "--steps", str(args.steps), "--run-dir", str(run_dir),
        "--set", f"model.preset={args.preset}", "--set", f"sync.codec={args.codec}",
        "--set", "run.tensorboard=false", "--set", "run.digest_every=0",
        *mode_settings(mode),
    ]  # fmt: skip
    for override in args.overrides:
        cmd += ["--set", override]
    print(f"[{mode}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"error: {mode} failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"[{mode}] done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return run_dir


def measure(run_dir: Path, tail: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    finals, tokens, wall = [], 0, 0.0
    for metrics in sorted((run_dir / "sites").glob("*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        finals.append(sum(r["loss"] for r in records[-tail:]) / len(records[-tail:]))
        tokens += sum(r["tokens"] for r in records)
        wall = max(wall, records[-1]["elapsed_s"])
    byte_count = summary["cross_site_bytes"]
    return {
        "final_loss": sum(finals) / len(finals),
        "tokens": tokens,
        "cross_site_bytes": byte_count,
        "bytes_per_token": byte_count / tokens if tokens else 0.0,
        "wall_s": wall,
        "tokens_per_s": summary["tokens_per_s"],
        "replicas_identical": len(set(summary["digests"].values())) == 1,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for mode in args.modes.split(","):
        rows[mode] = measure(run_mode(args, mode), args.tail)
    base = rows.get("step")
    print(
        f"{'mode':<12} {'final loss':>10} {'vs step':>8} {'bytes/token':>12} "
        f"{'fewer bytes':>11} {'tokens/s':>9} {'identical':>9}"
    )
    for mode, r in rows.items():
        gap = (r["final_loss"] / base["final_loss"] - 1) if base else 0.0
        fewer = (
            base["bytes_per_token"] / r["bytes_per_token"] if base and r["bytes_per_token"] else 1.0
        )
        r["loss_vs_step"], r["fewer_bytes_than_step"] = gap, fewer
        print(
            f"{mode:<12} {r['final_loss']:10.4f} {gap:+8.2%} {r['bytes_per_token']:12.1f} "
            f"{fewer:10.1f}x {r['tokens_per_s']:9.0f} {str(r['replicas_identical']):>9}"
        )
    out = args.json or args.out / "sync_modes.json"
    out.write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                "machine": f"{platform.node()} {platform.machine()}",
                "date": time.strftime("%Y-%m-%d"),
                "steps": args.steps,
                "preset": args.preset,
                "codec": args.codec,
                "tail": args.tail,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
