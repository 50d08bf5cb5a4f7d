"""Check the planning model (sim/plan.py) against emulated runs of `isthmus local`.

Calibration runs measure what the model takes as given on this machine: the
compute throughput of one process (one site alone, the same number of processes
as the checked run, so both share the cores alike) and the fixed cost of a
cross-site round (two sites over a link too fast to matter). Then every check run
is predicted from those figures plus its shape (sites, link bandwidth and RTT,
codec, model size) and compared with what the run measured: mean step time
(compute + exposed cross-site time) over the steps after warm-up, and the exposed
sync (what the optimizer step waited for) and busy sync (how long the rounds ran) on
their own.

    python benchmarks/plan_check.py [--steps 12] [--json out.json]

Prints a table and writes JSON. The codec ratio of a zstd run is read from that
run's summary: it is a property of the data, not of time, and the model takes it
as an input.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from isthmus.deploy.config.job import load_config
from isthmus.intra.model import Transformer
from isthmus.sim.plan import PlanInput, predict

WARMUP_STEPS = 2


@dataclass(frozen=True)
class Shape:
    name: str
    sites: int
    ranks: int
    preset: str
    codec: str = "raw"
    bandwidth_mbit: float = 1000.0
    latency_ms: float = 4.9

    def args(self, steps: int) -> list[str]:
        return [
            "--sites", str(self.sites),
            "--ranks-per-site", str(self.ranks),
            "--steps", str(steps),
            "--set", f"model.preset={self.preset}",
            "--set", f"sync.codec={self.codec}",
            "--set", f"wan.bandwidth_mbit={self.bandwidth_mbit}",
            "--set", f"wan.latency_ms={self.latency_ms}",
            "--set", "train.warmup_steps=1",
            "--set", "sync.mode=step",  # what the plan models; on GPUs the quick start would fit it
        ]  # fmt: skip


CHECKS = [
    Shape("2 sites, 1 Gbit/s, 9.8 ms RTT, raw", 2, 1, "small"),
    Shape("2 sites, 200 Mbit/s, 9.8 ms RTT, raw", 2, 1, "small", bandwidth_mbit=200),
    Shape("2 sites, 100 Mbit/s, 50 ms RTT, zstd:1", 2, 1, "small", "zstd:1", 100, 25),
    Shape("2 sites, 50 Mbit/s, 9.8 ms RTT, tiny model", 2, 1, "tiny", bandwidth_mbit=50),
    Shape("3 sites, 300 Mbit/s, 20 ms RTT, raw", 3, 1, "small", bandwidth_mbit=300, latency_ms=10),
    Shape("2 sites x 2 ranks, 400 Mbit/s, 9.8 ms, raw", 2, 2, "small", bandwidth_mbit=400),
]


def run(shape: Shape, steps: int, workdir: Path) -> dict:
    run_dir = workdir / shape.name.replace(" ", "_").replace(",", "").replace("/", "")
    cmd = [
        sys.executable,
        "-m",
        "isthmus.deploy.cli",
        "local",
        "--quiet",
        "--run-dir",
        str(run_dir),
    ]
    result = subprocess.run(cmd + shape.args(steps), capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{shape.name}: {result.stderr.strip().splitlines()[-1]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = lines[WARMUP_STEPS:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # The part of the sync the step waited for; runs before it existed kept it in
    # cross_site_s.
    exposed = [x.get("exposed_sync_s", x["cross_site_s"]) for x in timed]
    return {
        "step_s": statistics.mean(x["compute_s"] + e for x, e in zip(timed, exposed, strict=True)),
        "compute_s": statistics.mean(x["compute_s"] for x in timed),
        "sync_s": statistics.mean(exposed),
        "sync_busy_s": statistics.mean(x.get("sync_busy_s", 0.0) for x in timed),
        "ratio": summary["compression_ratio"],
        "chunk_bytes": load_config(run_dir / "config.toml").chunk_bytes,
        "tokens_per_step": timed[0]["tokens"],
    }


def codec_speed(spec: str) -> float:
    """Raw bytes/s one core encodes and decodes with `spec`, on gradient-like data."""
    import torch

    from isthmus.inter.data.codecs.chain import make_codec

    if spec == "raw":
        return float("inf")  # a copy: never the limit here
    codec = make_codec(spec)
    chunk = torch.randn(1 << 18) * 1e-3  # 1 MiB of fp32, gradient-sized values
    start = time.perf_counter()
    for _ in range(8):
        codec.decode(codec.encode(chunk), chunk.numel())
    return 8 * chunk.numel() * 4 / (time.perf_counter() - start)


def model_of(shape: Shape) -> tuple[float, int]:
    config = load_config(overrides=[f"model.preset={shape.preset}"])
    cfg = config.resolved_model()
    import torch

    with torch.device("meta"):
        model = Transformer(cfg)
    return float(model.num_params()), cfg.n_layers + 1  # FSDP groups = layers + root


def plan_input(
    shape: Shape,
    params: float,
    rounds: int,
    measured: dict,
    compute_s: float,
    round_overhead_s: float,
) -> PlanInput:
    """The planning model's input for ``shape``'s run: the compute and per-round
    overhead the calibration runs measured, the codec ratio and chunk of the run."""
    tokens = measured["tokens_per_step"]
    # Effective FLOP/s of one process, from the single-site calibration run.
    flops_per_device = 6 * params * (tokens / shape.sites) / (shape.ranks * compute_s)
    return PlanInput(
        params=params,
        tokens_per_step=tokens,
        sites=shape.sites,
        devices_per_site=shape.ranks,
        peak_flops=flops_per_device,
        mfu=1.0,
        gradient_bytes_per_param=4.0,
        codec_ratio=measured["ratio"],
        # All ranks of a site share the site's link.
        bandwidth_bps=shape.bandwidth_mbit * 1e6,
        rtt_s=2 * shape.latency_ms / 1000,
        rounds=rounds,
        chunk_bytes=measured["chunk_bytes"],
        round_overhead_s=round_overhead_s,
        codec_bytes_per_s=codec_speed(shape.codec),
        # Each group's round starts when its gradients exist: with equal groups
        # all but the first group's share of backward is there to hide behind.
        overlap=(rounds - 1) / rounds,
        # Two cores, busy with compute: see PlanInput.shared_cpu.
        shared_cpu=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="steps per run (first 2 are warm-up)")
    parser.add_argument("--json", default="plan_check.json", help="where to write the results")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        workdir = Path(tmp)
        compute_cache: dict[tuple[str, int], float] = {}
        overhead_cache: dict[tuple[str, int], float] = {}
        for shape in CHECKS:
            params, rounds = model_of(shape)
            procs = shape.sites * shape.ranks
            key = (shape.preset, procs)
            if key not in compute_cache:
                # One site with the same number of processes: the compute a site does.
                alone = run(Shape("cal compute", 1, procs, shape.preset), args.steps, workdir)
                compute_cache[key] = alone["compute_s"]
            if key not in overhead_cache:
                # The same sites over a link too fast to matter: the fixed cost per round.
                fast = Shape(
                    "cal overhead", shape.sites, shape.ranks, shape.preset, "raw", 100_000, 0.0
                )
                measured = run(fast, args.steps, workdir)
                overhead_cache[key] = max(0.0, measured["sync_s"]) / rounds
            measured = run(shape, args.steps, workdir)
            compute_s = compute_cache[key]
            inputs = plan_input(shape, params, rounds, measured, compute_s, overhead_cache[key])
            plan = predict(inputs)
            error = plan.step_s / measured["step_s"] - 1
            rows.append(
                {
                    "shape": shape.name,
                    "predicted_step_s": plan.step_s,
                    "measured_step_s": measured["step_s"],
                    # Exposed: what the step waited for; busy: how long the rounds ran.
                    "predicted_exposed_sync_s": plan.exposed_sync_s,
                    "measured_exposed_sync_s": measured["sync_s"],
                    "predicted_sync_busy_s": plan.sync_s,
                    "measured_sync_busy_s": measured["sync_busy_s"],
                    "error": error,
                    "limit": plan.limit,
                    "measured_compute_s": measured["compute_s"],
                    "inputs": {k: v for k, v in asdict(inputs).items() if v != float("inf")},
                }
            )
            print(
                f"{shape.name:<44} predicted {plan.step_s:6.3f} s  measured "
                f"{measured['step_s']:6.3f} s  error {error:+6.1%}  ({plan.limit}-bound)  "
                f"exposed sync {plan.exposed_sync_s:.3f} vs {measured['sync_s']:.3f} s",
                flush=True,
            )
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst error {worst:.1%} over {len(rows)} emulated runs (goal: within 15%)")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "steps": args.steps,
        "rows": rows,
        "worst_error": worst,
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
