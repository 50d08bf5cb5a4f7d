"""Sync modes side by side: training loss at equal tokens, WAN bytes per token and
scaling efficiency.

Runs `isthmus local` once per mode on the same job (same model, seed, sites and global
batch), and with --one-site also one site alone with the same layout, then prints one
row per mode: the training loss at equal tokens (mean over the sites and the --tail
steps that end at the step count every run reached) and the held-out loss of the model
the sites share at that step, their gaps to the per-step run,
bytes across sites per token and how many times fewer than per-step sync, steady
tokens/s and the scaling efficiency (S sites / (S x one site)).

    # quality (CPU, the issue's table)
    python3 benchmarks/sync_modes.py --out runs/modes --steps 400 --preset small \\
        --modes step,diloco:20,diloco:50 --codec raw
    # throughput (GPU host, 2 sites x 2 GPUs over 1000 km at 1 Gbit/s)
    python3 benchmarks/sync_modes.py --out runs/modes-gpu --one-site --preset 125m \\
        --ranks-per-site 2 --steps 100 --modes step@20,diloco:20,diloco:20:19 \\
        --codec int8 --set topology.device=cuda --set train.seq_len=2048 \\
        --set wan.bandwidth_mbit=1000

A mode is `step`, `diloco:H[:D]` (H inner steps, outer delay D; outer lr and
momentum from --set), `streaming:H:P[:D]` (P fragments, mixing from --set
sync.fragment_alpha) or `joined` (every rank of every site in one site: per-step
sync's math with an exact all-reduce, no codec and no link, so at full speed; when
present it is the loss baseline, for a per-step run over a thin link would take hours
to reach the outer modes' step counts), optionally `@STEPS` to run fewer steps than
--steps (a slow per-step baseline whose bytes per token are all that is wanted). A
run whose summary.json already exists under --out is not run again. Writes
OUT/sync_modes.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import parser, write_json

from isthmus.deploy.commands.arguments import add_set_argument
from isthmus.deploy.reports.summary import merge_steps, steady_state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, "run directories and the JSON go here")
    p.add_argument("--modes", default="step,diloco:20,diloco:50", help="comma separated")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--preset", default="small", help="model preset")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--ranks-per-site", type=int, default=1)
    p.add_argument("--codec", default="raw", help="sync.codec of every run")
    p.add_argument("--tail", type=int, default=20, help="steps the loss averages over")
    p.add_argument("--one-site", action="store_true", help="also run one site: efficiency")
    p.add_argument(
        "--one-site-steps",
        type=int,
        default=None,
        help="steps of the one-site run (default --steps): its steady tokens/s is all "
        "that is wanted of it",
    )
    add_set_argument(p, help="passed to every run")
    p.add_argument(
        "--steady-after",
        type=int,
        default=2,
        help="steps left out of the steady state (run.steady_after): with outer modes, "
        "past the first round, which absorbs the sites' start-up skew",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=16,
        help="held-out batches per measurement (run.eval_batches): the loss of the model "
        "the sites share on text never trained on, at the step every run reached",
    )
    p.add_argument("--eval-every", type=int, default=50, help="run.eval_every of every run")
    p.add_argument("--json", type=Path, default=None, help="default OUT/sync_modes.json")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    args = p.parse_args(argv)
    for mode in args.modes.split(","):
        mode_run(mode, args.steps)  # refuse a bad mode before anything runs
    return args


def mode_run(mode: str, default_steps: int) -> tuple[list[str], int]:
    """The `--set` arguments and the steps of one mode spec."""
    spec, _, steps = mode.partition("@")
    if steps and not (steps.isdigit() and int(steps) >= 1):
        raise SystemExit(f"error: mode {mode!r}: @STEPS must be a positive integer")
    name, *numbers = spec.split(":")
    count = int(steps) if steps else default_steps
    if name in ("step", "joined") and not numbers:
        return ["--set", "sync.mode=step"], count
    if name == "diloco" and 1 <= len(numbers) <= 2 and all(n.isdigit() for n in numbers):
        settings = ["--set", "sync.mode=diloco", "--set", f"sync.inner_steps={numbers[0]}"]
        if len(numbers) == 2:
            settings += ["--set", f"sync.outer_delay={numbers[1]}"]
        return settings, count
    if name == "streaming" and 2 <= len(numbers) <= 3 and all(n.isdigit() for n in numbers):
        settings = ["--set", "sync.mode=streaming", "--set", f"sync.inner_steps={numbers[0]}"]
        settings += ["--set", f"sync.fragments={numbers[1]}"]
        if len(numbers) == 3:
            settings += ["--set", f"sync.outer_delay={numbers[2]}"]
        return settings, count
    raise SystemExit(
        f"error: mode {mode!r}: expected step, joined, diloco:H[:D] or streaming:H:P[:D], "
        "then @STEPS or not"
    )


def is_joined(mode: str) -> bool:
    return mode.partition("@")[0] == "joined"


def run_dir_of(args: argparse.Namespace, mode: str) -> Path:
    return args.out / mode.replace(":", "-").replace("@", "-n")


def run(args: argparse.Namespace, name: str, run_dir: Path, sites: int, settings: list[str],
        steps: int, ranks_per_site: int | None = None) -> Path:  # fmt: skip
    if (run_dir / "summary.json").exists():
        return run_dir
    cmd = [
        sys.executable, "-m", "isthmus.deploy.cli", "local",
        "--sites", str(sites), "--ranks-per-site", str(ranks_per_site or args.ranks_per_site),
        "--steps", str(steps), "--run-dir", str(run_dir),
        "--set", f"model.preset={args.preset}", "--set", f"sync.codec={args.codec}",
        "--set", "run.tensorboard=false", "--set", "run.digest_every=0",
        "--set", f"run.steady_after={args.steady_after}",
        "--set", f"run.eval_batches={args.eval_batches}",
        "--set", f"run.eval_every={args.eval_every}",
        *settings,
    ]  # fmt: skip
    for override in args.overrides:
        cmd += ["--set", override]
    print(f"[{name}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"error: {name} failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"[{name}] done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return run_dir


def site_records(run_dir: Path) -> list[list[dict]]:
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted((run_dir / "sites").glob("*/metrics.jsonl"))
    ]


def tokens_per_s_before_last(sites: list[list[dict]], skip: int) -> float:
    """Steady tokens/s without the job's last step: the one round that always waits for
    all of the model (a one-time cost at the end, like start-up at the beginning).
    Computed as summary.json's steady tokens/s is, on the steps before the last."""
    merged = merge_steps({str(i): recs[:-1] for i, recs in enumerate(sites)})
    return steady_state(merged, skip).get("steady_tokens_per_s", 0.0)


def measure(run_dir: Path, tail: int, at_step: int) -> dict:
    """One run's row; the loss is taken over the `tail` steps before `at_step`."""
    summary = json.loads((run_dir / "summary.json").read_text())
    sites = site_records(run_dir)
    losses = [r["loss"] for recs in sites for r in recs if at_step - tail <= r["step"] < at_step]
    # Every held-out measurement, by the number of steps taken (where a gap opens).
    curve = {r["step"] + 1: r["val_loss"] for r in sites[0] if "val_loss" in r}
    tokens = sum(r["tokens"] for recs in sites for r in recs)
    byte_count = summary["cross_site_bytes"]
    return {
        "steps": summary["steps"],
        "loss_at_equal_tokens": sum(losses) / len(losses),
        "tokens": tokens,
        "cross_site_bytes": byte_count,
        "bytes_per_token": byte_count / tokens if tokens else 0.0,
        "wall_s": max(recs[-1]["elapsed_s"] for recs in sites),
        "steady_tokens_per_s": summary["steady_tokens_per_s"],
        "tokens_per_s_before_last": tokens_per_s_before_last(
            sites, max(1, summary["steady_after"])
        ),
        "exposed_sync_s_per_step": summary["exposed_sync_s_per_step"],
        # The inner steps' own time, the WAN aside: two sites on one host can slow
        # each other (memory bandwidth, PCIe, CPU) where sites in two places do not.
        # (A run no longer than its steady_after, a bytes-only baseline: all of its steps.)
        "median_compute_s": statistics.median(
            r["compute_s"] for recs in sites for r in (recs[summary["steady_after"] :] or recs)
        ),
        "replicas_identical": len(set(summary["digests"].values())) == 1,
        # The held-out loss measured after the step every run reached (it always is: the
        # last step of the shortest run, or a multiple of --eval-every).
        "val_loss": curve.get(at_step),
        "val_curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    one_site, one_before_last = None, 0.0
    if args.one_site:
        one_steps = args.one_site_steps or args.steps
        one = run(args, "one site", args.out / "one-site", 1, ["--set", "sync.mode=step"],
                  one_steps)  # fmt: skip
        one_site = json.loads((one / "summary.json").read_text())["steady_tokens_per_s"]
        one_row = measure(one, args.tail, one_steps)
        one_before_last = one_row["tokens_per_s_before_last"]
        print(f"one site: {one_site:,.0f} tokens/s, median compute "
              f"{one_row['median_compute_s']:.4f} s/step")  # fmt: skip
    dirs, steps_of = {}, {}
    for mode in args.modes.split(","):
        settings, steps_of[mode] = mode_run(mode, args.steps)
        # `joined`: the same ranks, all in one site.
        sites, ranks = (
            (1, args.sites * args.ranks_per_site) if is_joined(mode) else (args.sites, None)
        )
        dirs[mode] = run(args, mode, run_dir_of(args, mode), sites, settings, steps_of[mode], ranks)
    # The loss baseline: the joined run where there is one (the same math at full speed;
    # a per-step run beside it is then there for its bytes only, compared at its own
    # last step), else per-step sync. Bytes compare with per-step sync.
    joined = next((m for m in dirs if is_joined(m)), None)
    bytes_only = {m for m in dirs if joined and m.startswith("step")}
    common = min(steps_of[m] for m in dirs if m not in bytes_only)
    rows = {
        mode: measure(d, args.tail, steps_of[mode] if mode in bytes_only else common)
        for mode, d in dirs.items()
    }
    step_row = next((r for m, r in rows.items() if m.startswith("step")), None)
    base = rows[joined] if joined else step_row
    print(
        f"{'mode':<16} {'steps':>5} {'loss@' + str(common):>9} {'vs base':>8} "
        f"{'bytes/token':>12} {'fewer':>8} {'tokens/s':>9} {'scaling':>8} "
        f"{'w/o last':>8} {'identical':>9} {'held-out':>10} {'vs base':>8}"
    )
    for mode, r in rows.items():
        gap = (
            r["loss_at_equal_tokens"] / base["loss_at_equal_tokens"] - 1
            if base and mode not in bytes_only
            else None
        )
        fewer = (
            step_row["bytes_per_token"] / r["bytes_per_token"]
            if step_row and r["bytes_per_token"]
            else None  # sends nothing: the joined run
        )
        # Scaling is of the sites' runs; the joined one holds all their GPUs in one site.
        scaled = one_site and mode != joined
        scaling = r["steady_tokens_per_s"] / (args.sites * one_site) if scaled else None
        # The same without each run's last step (DiLoCo's final round of the whole model).
        before_last = (
            r["tokens_per_s_before_last"] / (args.sites * one_before_last) if scaled else None
        )
        # The shared model's held-out loss at the step every run reached.
        final, base_final = r["val_loss"], base and base["val_loss"]
        final_gap = (
            final / base_final - 1
            if final is not None and base_final and mode not in bytes_only
            else None
        )
        r.update(
            val_loss_vs_step=final_gap,
            loss_vs_step=gap,
            fewer_bytes_than_step=fewer,
            scaling_efficiency=scaling,
            scaling_efficiency_before_last_step=before_last,
        )
        print(
            f"{mode:<16} {r['steps']:5d} {r['loss_at_equal_tokens']:9.4f} "
            f"{'-' if gap is None else f'{gap:+.2%}':>8} "
            f"{r['bytes_per_token']:12.1f} {'-' if fewer is None else f'{fewer:.1f}x':>8} "
            f"{r['steady_tokens_per_s']:9.0f} "
            f"{'-' if scaling is None else f'{scaling:.1%}':>8} "
            f"{'-' if before_last is None else f'{before_last:.1%}':>8} "
            f"{str(r['replicas_identical']):>9} "
            f"{'-' if final is None else f'{final:.4f}':>10} "
            f"{'-' if final_gap is None else f'{final_gap:+.2%}':>8}"
        )
    out = write_json(
        args.json or args.out / "sync_modes.json",
        {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "machine": f"{platform.node()} {platform.machine()}",
            "date": time.strftime("%Y-%m-%d"),
            "preset": args.preset,
            "codec": args.codec,
            "loss_at_step": common,
            "loss_baseline": next((m for m, r in rows.items() if r is base), None),
            "tail": args.tail,
            "steady_after": args.steady_after,
            "one_site_tokens_per_s": one_site,
            "one_site_tokens_per_s_before_last": one_before_last or None,
            "rows": rows,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
