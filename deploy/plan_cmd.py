"""`isthmus plan`: predict step time and scaling efficiency with the planning model."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace

from isthmus.deploy.config import ConfigError
from isthmus.sim.plan import Plan, PlanInput, bandwidth_for_efficiency, nemotron_340b, predict

NEMO_EFFICIENCY = 0.96  # NVIDIA NeMo's published two-site figure for Nemotron-4 340B


def register(sub: argparse._SubParsersAction, formatter: type) -> None:
    """Add `isthmus plan` to the CLI."""
    default = nemotron_340b()
    parser = sub.add_parser(
        "plan",
        help="predict step time and scaling efficiency at any size",
        description="Predict a multi-site job's step time, cross-site time and scaling "
        "efficiency from model size, tokens per step, devices x peak x MFU, sites, "
        "link bandwidth and RTT, codec ratio and overlap (the model is in "
        "sim/plan.py). The defaults are Nemotron-4 340B over two sites 1000 km apart; "
        "the bandwidth that the target efficiency needs is printed next to NeMo's 96%.",
        formatter_class=formatter,
    )
    add = parser.add_argument
    add("--params", type=float, default=default.params, help="trained parameters")
    add(
        "--tokens-per-step",
        type=float,
        default=default.tokens_per_step,
        help="global batch in tokens",
    )
    add("--sites", type=int, default=default.sites, help="sites, each a data-parallel replica")
    add("--devices-per-site", type=int, default=default.devices_per_site, help="GPUs per site")
    add("--peak-tflops", type=float, default=default.peak_flops / 1e12, help="peak TFLOP/s per GPU")
    add("--mfu", type=float, default=default.mfu, help="model FLOPs utilisation inside a site")
    add(
        "--gradient-bytes",
        type=float,
        default=default.gradient_bytes_per_param,
        help="bytes per gradient element before the codec (4 fp32, 2 bf16)",
    )
    add("--codec-ratio", type=float, default=1.0, help="raw bytes / wire bytes of the codec")
    add(
        "--bandwidth-gbit",
        type=float,
        default=default.bandwidth_bps / 1e9,
        help="per-site link, Gbit/s",
    )
    add("--distance-km", type=float, default=1000.0, help="fiber distance between sites")
    add("--rtt-ms", type=float, default=None, help="round-trip time; overrides --distance-km")
    add(
        "--rounds",
        type=int,
        default=default.rounds,
        help="cross-site rounds (FSDP groups) per step",
    )
    add(
        "--chunk-mib", type=float, default=default.chunk_bytes / 2**20, help="chunk of a round, MiB"
    )
    add(
        "--overlap",
        type=float,
        default=default.overlap,
        help="share of backward that hides sync, 0..1",
    )
    add(
        "--target-efficiency",
        type=float,
        default=NEMO_EFFICIENCY,
        help="efficiency to solve bandwidth for",
    )
    add("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    rtt_s = args.rtt_ms / 1000 if args.rtt_ms is not None else 2 * args.distance_km * 4.9e-6
    try:
        inputs = PlanInput(
            params=args.params,
            tokens_per_step=args.tokens_per_step,
            sites=args.sites,
            devices_per_site=args.devices_per_site,
            peak_flops=args.peak_tflops * 1e12,
            mfu=args.mfu,
            gradient_bytes_per_param=args.gradient_bytes,
            codec_ratio=args.codec_ratio,
            bandwidth_bps=args.bandwidth_gbit * 1e9,
            rtt_s=rtt_s,
            overlap=args.overlap,
            rounds=args.rounds,
            chunk_bytes=args.chunk_mib * 2**20,
        )
        plan = predict(inputs)
        needed = bandwidth_for_efficiency(inputs, args.target_efficiency)
        no_overlap = bandwidth_for_efficiency(replace(inputs, overlap=0.0), args.target_efficiency)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.json:
        out = {
            "inputs": asdict(inputs),
            "prediction": {k: v for k, v in asdict(plan).items() if k != "inputs"},
            "limit": plan.limit,
            "target_efficiency": args.target_efficiency,
            "bandwidth_needed_bps": needed,
            "bandwidth_needed_without_overlap_bps": no_overlap,
        }
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
        return 0
    print_plan(plan, args.target_efficiency, needed, no_overlap)
    return 0


def _gbit(bps: float) -> str:
    return "unreachable" if math.isinf(bps) else f"{bps / 1e9:,.1f} Gbit/s"


def print_plan(plan: Plan, target: float, needed: float, no_overlap: float) -> None:
    p = plan.inputs
    rows = [
        (
            "model",
            f"{p.params / 1e9:,.1f}B parameters, {p.tokens_per_step / 1e6:,.2f}M tokens/step",
        ),
        ("sites", f"{p.sites} x {p.devices_per_site} devices at {p.mfu:.0%} MFU"),
        ("link", f"{p.bandwidth_bps / 1e9:,.1f} Gbit/s per site, RTT {p.rtt_s * 1e3:.1f} ms"),
        ("compute per step", f"{plan.compute_s:.2f} s"),
        (
            "cross-site per step",
            f"{plan.sync_s:.2f} s ({plan.wire_bytes_per_site / 1e9:,.1f} GB per site, {plan.limit}-bound)",
        ),
        (
            "exposed after overlap",
            f"{plan.exposed_sync_s:.2f} s (overlap {p.overlap:.0%} of backward)",
        ),
        ("step", f"{plan.step_s:.2f} s, {plan.tokens_per_s:,.0f} tokens/s"),
        ("scaling efficiency", f"{plan.scaling_efficiency:.1%}"),
        (f"bandwidth for {target:.0%}", f"{_gbit(needed)} (without overlap: {_gbit(no_overlap)})"),
        (
            "NVIDIA NeMo, published",
            f"{NEMO_EFFICIENCY:.0%} for Nemotron-4 340B over two sites ~1000 km apart",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
