"""`isthmus plan`: predict step time and scaling efficiency with the planning model
(sim/plan.py), from Nemotron-4 340B over two sites (NeMo's published scenario) or, with
`--preset NAME`, one of isthmus' own models as `isthmus local` would train it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

from isthmus.deploy.commands import add_command
from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.config.planning import codec_ratio, preset_input
from isthmus.deploy.config.wan_section import read_probe
from isthmus.sim.plan import (
    Plan,
    PlanInput,
    bandwidth_for_efficiency,
    nemotron_340b,
    predict,
    scaling_curve,
)

NEMO_EFFICIENCY = 0.96  # NVIDIA NeMo's published two-site figure for Nemotron-4 340B


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "plan", cmd_plan)
    add = parser.add_argument
    _add_job_flags(add)
    _add_link_flags(add)
    _add_round_flags(add)
    add(
        "--target-efficiency",
        type=float,
        default=NEMO_EFFICIENCY,
        help="efficiency to solve bandwidth for",
    )
    add("--json", action="store_true", help="print JSON instead of a table")


def _add_job_flags(add: Callable[..., argparse.Action]) -> None:
    """The model, its batch and the sites' devices."""
    add("--preset", help="isthmus model preset (tiny ... 1b) instead of the 340B")
    add("--params", type=float, help="trained parameters (default: the model's)")
    add(
        "--tokens-per-step",
        type=float,
        help="global batch in tokens (default: the 340B's, or --batch x --seq x devices x sites)",
    )
    add("--batch", help="sequences per device per step; a comma list (4,8,16) prints the curve")
    add("--seq", type=int, default=2048, help="tokens per sequence with --batch")
    add("--sites", type=int, default=2, help="sites, each a data-parallel replica")
    add(
        "--devices-per-site",
        type=int,
        help="GPUs per site (default 1536 for the 340B, 1 with --preset)",
    )
    add("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s per GPU (H100 bf16)")
    add("--mfu", type=float, help="model FLOPs utilisation inside a site")
    add(
        "--gradient-bytes",
        type=float,
        help="bytes per gradient element before the codec (4 fp32, 2 bf16)",
    )


def _add_link_flags(add: Callable[..., argparse.Action]) -> None:
    """The codec and the link between sites."""
    add("--codec", help="sync.codec of the job: sets --codec-ratio from its tensor codec")
    add("--codec-ratio", type=float, help="raw bytes / wire bytes of the codec")
    add(
        "--bandwidth-gbit",
        "--gbit",
        dest="bandwidth_gbit",
        type=float,
        help="per-site link, Gbit/s (default 400 for the 340B, 1 with --preset)",
    )
    add("--distance-km", type=float, default=1000.0, help="fiber distance between sites")
    add("--rtt-ms", type=float, help="round-trip time; overrides --distance-km")
    add(
        "--probe",
        metavar="JSON",
        help="`isthmus probe --json` file: its slowest link's RTT and rate replace "
        "--rtt-ms and --gbit",
    )


def _add_round_flags(add: Callable[..., argparse.Action]) -> None:
    """How the cross-site rounds run: their count, window, chunks, overlap and period."""
    add("--rounds", type=int, help="cross-site rounds (FSDP groups) per step")
    add(
        "--window",
        type=int,
        help="rounds in flight at once (default 1 for the 340B, "
        "sync.rounds_in_flight with --preset)",
    )
    add("--chunk-mib", type=float, help="chunk of a round, MiB")
    add(
        "--overlap",
        type=float,
        help="share of backward that hides sync, 0..1 (default "
        "(rounds-1)/rounds with --preset: each group's round starts when its gradients "
        "exist)",
    )
    add(
        "--activation-checkpoint",
        action="store_true",
        help="blocks recompute their forward in "
        "backward (parallel.activation_checkpoint): 3/4 of compute is backward; give the MFU such "
        "a run reports",
    )
    add(
        "--inner-steps",
        type=int,
        default=1,
        help="steps between cross-site rounds: 1 = per-step "
        "sync, H > 1 = DiLoCo (sync.mode=diloco, sync.inner_steps)",
    )
    add(
        "--outer-delay",
        type=int,
        default=0,
        help="DiLoCo: steps a round runs behind (sync.outer_delay), 0..H/P-1",
    )
    add(
        "--fragments",
        type=int,
        default=1,
        help="Streaming DiLoCo: fragments synced in turn "
        "(sync.mode=streaming, sync.fragments), a divisor of H; 1 = DiLoCo",
    )
    add(
        "--round-overhead-ms",
        type=float,
        default=0.0,
        help="fixed cost of a round beyond its bytes",
    )


def build_input(args: argparse.Namespace) -> tuple[PlanInput, list[int]]:
    """The PlanInput the arguments describe and the per-device batches asked for."""
    if args.probe:
        args.rtt_ms, mbit, _, line = read_probe(args.probe)
        args.bandwidth_gbit = mbit / 1000
        print(line, file=sys.stderr)
    rtt_s = args.rtt_ms / 1000 if args.rtt_ms is not None else 2 * args.distance_km * 4.9e-6
    try:
        batches = [int(b) for b in args.batch.split(",")] if args.batch else []
    except ValueError:
        raise ConfigError(
            f"--batch must be integers separated by commas, got {args.batch!r}"
        ) from None
    ratio = args.codec_ratio
    if ratio is None and args.codec is not None:
        ratio = codec_ratio(args.codec)
    fields = {
        "params": args.params,
        "tokens_per_step": args.tokens_per_step,
        "sites": args.sites,
        "devices_per_site": args.devices_per_site,
        "peak_flops": args.peak_tflops * 1e12,
        "mfu": args.mfu,
        "gradient_bytes_per_param": args.gradient_bytes,
        "codec_ratio": ratio,
        "rounds": args.rounds,
        "window": args.window,
        "chunk_bytes": args.chunk_mib * 2**20 if args.chunk_mib is not None else None,
        "overlap": args.overlap,
        "round_overhead_s": args.round_overhead_ms / 1000,
        "backward_share": 0.75 if args.activation_checkpoint else None,
        "inner_steps": args.inner_steps,
        "outer_delay": args.outer_delay,
        "fragments": args.fragments,
    }
    if args.preset is not None:
        bandwidth = (args.bandwidth_gbit if args.bandwidth_gbit is not None else 1.0) * 1e9
        inputs = preset_input(
            args.preset, seq_len=args.seq, bandwidth_bps=bandwidth, rtt_s=rtt_s, **fields
        )
    else:
        fields["bandwidth_bps"] = (
            args.bandwidth_gbit * 1e9 if args.bandwidth_gbit is not None else None
        )
        fields["rtt_s"] = rtt_s
        inputs = replace(nemotron_340b(), **{k: v for k, v in fields.items() if v is not None})
    if batches and args.tokens_per_step is None:
        b = batches[0]
        inputs = replace(
            inputs, tokens_per_step=b * args.seq * inputs.devices_per_site * inputs.sites
        )
    return inputs, batches


def cmd_plan(args: argparse.Namespace) -> int:
    """predict step time and scaling efficiency at any size

    Predict a multi-site job's step time, cross-site time, exposed sync and scaling
    efficiency from model size, tokens per step, devices x peak x MFU, sites, link bandwidth
    and RTT, codec and overlap (the model is in sim/plan.py). The defaults are Nemotron-4
    340B over two sites 1000 km apart, printed next to the bandwidth NeMo's 96% needs;
    --preset NAME plans one of isthmus' models as `isthmus local` trains it, --batch 4,8,16
    the efficiency curve against the per-device batch."""
    try:
        inputs, batches = build_input(args)
        plan = predict(inputs)
        needed = bandwidth_for_efficiency(inputs, args.target_efficiency)
        no_overlap = bandwidth_for_efficiency(replace(inputs, overlap=0.0), args.target_efficiency)
        curve = scaling_curve(inputs, batches, args.seq) if len(batches) > 1 else []
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.json:
        out = {
            "inputs": asdict(inputs),
            "prediction": prediction_dict(plan),
            "limit": plan.limit,
            "target_efficiency": args.target_efficiency,
            "bandwidth_needed_bps": needed,
            "bandwidth_needed_without_overlap_bps": no_overlap,
        }
        if curve:
            out["curve"] = [
                {"batch": b, "seq_len": args.seq, **prediction_dict(c)}
                for b, c in zip(batches, curve, strict=True)
            ]
        json.dump(finite(out), sys.stdout, indent=2, default=str)
        print()
        return 0
    if curve:
        print_curve(batches, args.seq, curve)
        return 0
    print_plan(plan, args.target_efficiency, needed, no_overlap)
    return 0


def finite(value):
    """JSON has no infinity: an unbounded figure (no codec limit, no bandwidth enough)
    is written as null."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


def prediction_dict(plan: Plan) -> dict:
    """A Plan's numbers (inputs left out), with the derived ones a run reports too."""
    out = {k: v for k, v in asdict(plan).items() if k != "inputs"}
    out["one_site_tokens_per_s"] = plan.one_site_tokens_per_s
    out["overlap"] = plan.overlap
    out["limit"] = plan.limit
    return out


def _gbit(bps: float) -> str:
    return "unreachable" if math.isinf(bps) else f"{bps / 1e9:,.1f} Gbit/s"


def _describe(p: PlanInput) -> list[tuple[str, str]]:
    return [
        (
            "model",
            f"{p.params / 1e9:,.{1 if p.params >= 1e10 else 2}f}B parameters"
            + (
                f" ({p.active_params / 1e9:,.2f}B active a token)"
                if 0 < p.active_params < p.params
                else ""
            )
            + f", {p.rounds} rounds (FSDP groups) per step",
        ),
        ("sites", f"{p.sites} x {p.devices_per_site} devices at {p.mfu:.0%} MFU"),
        (
            "sync",
            "every step"
            if p.inner_steps == 1
            else f"DiLoCo: every {p.inner_steps} steps, {p.outer_delay} steps behind"
            if p.fragments == 1
            else f"Streaming DiLoCo: {p.fragments} fragments, one every "
            f"{p.inner_steps // p.fragments} of {p.inner_steps} steps, "
            f"{p.outer_delay} steps behind",
        ),
        (
            "link",
            f"{p.bandwidth_bps / 1e9:,.1f} Gbit/s per site, RTT {p.rtt_s * 1e3:.1f} ms, "
            f"codec ratio {p.codec_ratio:g}",
        ),
    ]


def print_curve(batches: list[int], seq_len: int, curve: list[Plan]) -> None:
    """The efficiency curve against the per-device batch, one row per batch."""
    for name, value in _describe(curve[0].inputs):
        print(f"  {name:<6}  {value}")
    print(f"  link time per step {curve[0].sync_s:.3f} s ({curve[0].limit}-bound)")
    header = (
        f"  {'batch':>9}  {'compute s':>9}  {'sync s':>7}  {'exposed s':>9}  {'step s':>7}  "
        f"{'1-site tok/s':>12}  {'all tok/s':>10}  {'efficiency':>10}"
    )
    print(header)
    for b, c in zip(batches, curve, strict=True):
        print(
            f"  {f'{b} x {seq_len}':>9}  {c.compute_s:9.3f}  {c.sync_s:7.3f}  "
            f"{c.exposed_sync_s:9.3f}  {c.step_s:7.3f}  {c.one_site_tokens_per_s:12,.0f}  "
            f"{c.tokens_per_s:10,.0f}  {c.scaling_efficiency:10.1%}"
        )


def print_plan(plan: Plan, target: float, needed: float, no_overlap: float) -> None:
    p = plan.inputs
    rows = [
        *_describe(p),
        ("tokens per step", f"{p.tokens_per_step / 1e6:,.2f}M over all sites"),
        ("compute per step", f"{plan.compute_s:.2f} s"),
        (
            "cross-site per step",
            f"{plan.sync_s:.2f} s ({plan.wire_bytes_per_site / 1e9:,.2f} GB per site, {plan.limit}-bound)",
        ),
        (
            "exposed after overlap",
            f"{plan.exposed_sync_s:.2f} s (overlap {p.overlap:.0%} of backward)",
        ),
        ("step", f"{plan.step_s:.2f} s, {plan.tokens_per_s:,.0f} tokens/s"),
        ("scaling efficiency", f"{plan.scaling_efficiency:.1%}"),
        (f"bandwidth for {target:.0%}", f"{_gbit(needed)} (without overlap: {_gbit(no_overlap)})"),
    ]
    if p.params > 1e11:
        rows.append(
            (
                "NVIDIA NeMo, published",
                f"{NEMO_EFFICIENCY:.0%} for Nemotron-4 340B over two sites ~1000 km apart",
            )
        )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
