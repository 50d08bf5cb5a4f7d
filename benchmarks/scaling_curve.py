"""Scaling efficiency against the per-GPU batch: one site vs several, next to the plan.

For each per-device batch, runs `isthmus local` with one site and with `--sites`
sites (same ranks per site, same per-rank batch), reads both runs' summary.json and
prints one row: steady-state tokens/s of each, scaling efficiency = S-site / (S x
one-site), the exposed sync per step (what the optimizer step waited for), how long
the rounds ran, and what the planning model (sim/plan.py) predicts for the same point
from the one-site run's measured compute and the job's link, codec and model.

    python3 benchmarks/scaling_curve.py --out runs/curve --batches 4,8,16 \\
        --preset 1b --seq 2048 --ranks-per-site 2 --codec int8 --steps 12 \\
        --set wan.bandwidth_mbit=10000 --set topology.device=cuda

A run whose summary.json already exists under --out is not run again (an interrupted
curve goes on where it stopped); --tabulate-only runs nothing. Writes
OUT/scaling_curve.json (or --json). benchmarks/gpu_runs.sh headline runs this on a GPU host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from _common import parser, stamped, write_json

from isthmus.deploy.commands.arguments import add_set_argument
from isthmus.deploy.config.job import JobConfig, load_config
from isthmus.sim.plan import PlanInput, predict


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, "run directories and the JSON go here")
    p.add_argument("--batches", default="4,8,16", help="per-device batches, comma separated")
    p.add_argument("--sites", type=int, default=2, help="sites of the multi-site runs")
    p.add_argument("--ranks-per-site", type=int, default=2, help="ranks (GPUs) per site")
    p.add_argument("--preset", default="1b", help="model preset")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--codec", default="int8", help="sync.codec of the multi-site runs")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument(
        "--warmup", type=int, default=3, help="steps left out of steady state (run.steady_after)"
    )
    add_set_argument(
        p, help="passed to every isthmus local run (the link: wan.bandwidth_mbit=10000)"
    )
    p.add_argument(
        "--json", type=Path, default=None, help="where the table goes (OUT/scaling_curve.json)"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--tabulate-only", action="store_true", help="run nothing; read --out")
    return p.parse_args(argv)


def run_args(args: argparse.Namespace, sites: int, batch: int) -> list[str]:
    """The `isthmus local` arguments of one run."""
    sets = [
        f"model.preset={args.preset}",
        f"train.seq_len={args.seq}",
        f"train.batch_size={batch}",
        f"sync.codec={args.codec}",
        f"run.steady_after={args.warmup}",
        # A digest gathers the full parameters: once, after the last step, is enough.
        "run.digest_every=0",
        # Named, so the quick start does not fit it: on GPUs `isthmus local` picks
        # streaming where the plan predicts per-step sync under 50 % (a 125m job at
        # 10 Gbit/s), and a short run would then sync only once, at its end.
        # A later --set sync.mode=... wins.
        "sync.mode=step",
        *args.overrides,
    ]
    return [
        "--sites", str(sites),
        "--ranks-per-site", str(args.ranks_per_site),
        "--steps", str(args.steps),
        *(x for s in sets for x in ("--set", s)),
    ]  # fmt: skip


def run_dir(args: argparse.Namespace, sites: int, batch: int) -> Path:
    """Where one run goes, named by its arguments: a run is reused only by the same run."""
    digest = hashlib.sha1(" ".join(run_args(args, sites, batch)).encode()).hexdigest()[:8]
    return args.out / f"sites{sites}-batch{batch}-{digest}"


def run_once(args: argparse.Namespace, sites: int, batch: int) -> None:
    """One `isthmus local` run into its directory, unless it already finished."""
    where = run_dir(args, sites, batch)
    if (where / "summary.json").exists():
        return
    cmd = [sys.executable, "-m", "isthmus.deploy.cli", "local", "--quiet", "--run-dir", str(where)]
    started = time.monotonic()
    result = subprocess.run(
        cmd + run_args(args, sites, batch),
        capture_output=True,
        text=True,
        timeout=args.timeout,
        stdin=subprocess.DEVNULL,
    )
    wall = time.monotonic() - started
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{sites} site(s), batch {batch} failed after {wall:.0f} s:\n{tail}")
    (where / "wall_s.txt").write_text(f"{wall:.1f}\n")
    print(f"ran {sites} site(s) x batch {batch} in {wall:.0f} s", file=sys.stderr, flush=True)


def uses_cuda(config: JobConfig) -> bool:
    if config.topology.device == "auto":
        import torch

        return torch.cuda.is_available()
    return config.topology.device == "cuda"


def prediction(config: JobConfig, one: dict, multi: dict) -> dict:
    """The planning model's figures for the multi-site run, from the one-site run's compute.

    The model takes compute as given: the one-site run's mean compute per step sets
    the devices' effective FLOP/s, its other per-step time (metrics, batches) the step
    overhead; the link, codec ratio (as measured), chunk, rounds and model size come
    from the multi-site run's config and summary.
    """
    import torch

    from isthmus.intra.model import Transformer

    cfg = config.resolved_model()
    with torch.device("meta"):
        model = Transformer(cfg)
    flops_per_token = model.flops_per_token(config.train.seq_len)
    sites, ranks = config.topology.sites, config.topology.ranks_per_site
    dp = ranks // (config.topology.pp * config.topology.tp)
    tokens_per_site = config.train.batch_size * config.train.seq_len * dp
    compute_s = one["compute_s_per_step"]
    rounds = cfg.n_layers + 1  # one FSDP group per block, plus the root's own
    inputs = PlanInput(
        params=float(model.num_params()),
        flops_per_token=flops_per_token,
        tokens_per_step=tokens_per_site * sites,
        sites=sites,
        devices_per_site=ranks,
        peak_flops=flops_per_token * tokens_per_site / (ranks * compute_s),
        mfu=1.0,
        gradient_bytes_per_param=4.0,
        codec_ratio=multi["compression_ratio"],
        bandwidth_bps=config.wan.bandwidth_mbit * 1e6,
        rtt_s=2 * config.one_way_latency_s,
        rounds=rounds,
        window=config.sync.rounds_in_flight,
        chunk_bytes=float(config.chunk_bytes),
        overlap=(rounds - 1) / rounds,
        backward_share=0.75 if config.parallel.activation_checkpoint else 2 / 3,
        step_overhead_s=max(0.0, one["steady_step_s"] - compute_s),
        # CPU ranks and lanes share the cores: nothing hides behind backward there.
        shared_cpu=not uses_cuda(config),
    )
    plan = predict(inputs)
    return {
        "predicted_efficiency": plan.scaling_efficiency,
        "predicted_exposed_sync_s": plan.exposed_sync_s,
        "predicted_sync_s": plan.sync_s,
        "predicted_limit": plan.limit,
    }


def _wall(where: Path) -> float | None:
    path = where / "wall_s.txt"
    return float(path.read_text()) if path.exists() else None


def row(args: argparse.Namespace, batch: int) -> dict | None:
    """One batch's figures, or None while one of its runs is missing."""
    sites = args.sites
    one_dir, multi_dir = run_dir(args, 1, batch), run_dir(args, sites, batch)
    if not ((one_dir / "summary.json").exists() and (multi_dir / "summary.json").exists()):
        return None
    one = json.loads((one_dir / "summary.json").read_text())
    multi = json.loads((multi_dir / "summary.json").read_text())
    config = load_config(multi_dir / "config.toml")
    one_tps, multi_tps = one["steady_tokens_per_s"], multi["steady_tokens_per_s"]
    return {
        "batch": batch,
        "seq_len": config.train.seq_len,
        "one_site_tokens_per_s": one_tps,
        "multi_site_tokens_per_s": multi_tps,
        "scaling_efficiency": multi_tps / (sites * one_tps) if one_tps else 0.0,
        "one_site_step_s": one["steady_step_s"],
        "multi_site_step_s": multi["steady_step_s"],
        "compute_s_per_step": one["compute_s_per_step"],
        "exposed_sync_s_per_step": multi["exposed_sync_s_per_step"],
        "sync_busy_s_per_step": multi["sync_busy_s_per_step"],
        "overlap": multi["overlap"],
        "one_site_mfu": one["mfu"],
        "multi_site_mfu": multi["mfu"],
        "compression_ratio": multi["compression_ratio"],
        "steady_steps": multi["steady_steps"],
        "replicas_identical": len(set(multi["digests"].values())) == 1,
        # Whole runs, start-up and compilation included: what a device call must fit.
        "one_site_run_s": _wall(one_dir),
        "multi_site_run_s": _wall(multi_dir),
        **prediction(config, one, multi),
    }


def print_table(rows: list[dict], sites: int) -> None:
    print(
        f"{'batch':>9}  {'1-site tok/s':>12}  {f'{sites}-site tok/s':>12}  {'efficiency':>10}  "
        f"{'exposed s/step':>14}  {'sync s/step':>11}  {'plan eff.':>9}  {'plan exposed':>12}"
    )
    for r in rows:
        shape = f"{r['batch']} x {r['seq_len']}"
        print(
            f"{shape:>9}  {r['one_site_tokens_per_s']:12,.0f}  "
            f"{r['multi_site_tokens_per_s']:12,.0f}  {r['scaling_efficiency']:10.1%}  "
            f"{r['exposed_sync_s_per_step']:14.3f}  {r['sync_busy_s_per_step']:11.3f}  "
            f"{r['predicted_efficiency']:9.1%}  {r['predicted_exposed_sync_s']:12.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.replace(" ", ",").split(",") if b]
    except ValueError:
        print(f"error: --batches must be integers, got {args.batches!r}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.tabulate_only:
        for batch in batches:
            for sites in (1, args.sites):
                try:
                    run_once(args, sites, batch)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    # One point failing (out of memory at a large batch) leaves the rest.
                    print(f"error: {exc}", file=sys.stderr, flush=True)
                    failed.append(batch)
                    break
    rows = [r for r in (row(args, b) for b in batches) if r is not None]
    if not rows:
        print(f"error: no batch has both runs under {args.out}", file=sys.stderr)
        return 1
    print_table(rows, args.sites)
    result = {
        "preset": args.preset,
        "sites": args.sites,
        "ranks_per_site": args.ranks_per_site,
        "codec": args.codec,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "overrides": args.overrides,
        "rows": rows,
    }
    write_json(args.json or args.out / "scaling_curve.json", stamped(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
