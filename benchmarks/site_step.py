"""One site's training step: tokens/s, MFU, and the step split into compute and communication.

Run under torchrun, one process per device of the site:

    torchrun --nproc-per-node 4 benchmarks/site_step.py --preset 1b --tp 2 --dp 2 \\
        --batch 8 --seq 2048 --compile --json runs/site_step.json
    torchrun --nproc-per-node 4 benchmarks/site_step.py --preset tiny --tp 2 --seq 64  # CPU, gloo

The split comes from ``torch.profiler`` over ``--profile-steps`` steps, per rank
(rank 0 is reported; the JSON holds every rank's):

- ``compute_s``: busy time of the device's non-communication kernels per step
  (on CPU: the step minus ``comm_s``; CPU numbers are rough);
- ``comm_s``: time inside intra-site collectives per step (NCCL kernels on GPU,
  c10d/gloo ops on CPU); some of it overlaps compute;
- ``exposed_s``: step time minus ``compute_s`` -- communication (and launch gaps)
  that nothing hid.

MFU uses ``Transformer.flops_per_token`` (6N + 12 L d T, no recompute) and the
device peak from ``isthmus.intra.flops.PEAK_FLOPS``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import finish_ranks, parser
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from isthmus.intra.flops import device_peak_flops, mfu
from isthmus.intra.layout import ParallelConfig, ParallelLayout, PipelineSchedule
from isthmus.intra.model import Transformer, build_model
from isthmus.intra.model_config import preset
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer

COMM_MARKERS = (
    *("nccl", "gloo", "c10d::", "all_gather", "allgather", "reduce_scatter", "allreduce"),
    *("all_to_all", "alltoall"),
)
# Expert parallelism's token exchange: NCCL runs all_to_all as grouped send/recv
# (kernel ncclDevKernel_SendRecv); nothing else in a step sends point to point
# unless pp > 1.
ALL_TO_ALL_MARKERS = ("all_to_all", "alltoall", "sendrecv")


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--preset", default="tiny", help="model preset (tiny, small, 125m, 350m, 1b)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (moe presets)")
    p.add_argument(
        "--dp", type=int, default=None, help="data-parallel ranks (default: world / (pp*cp*tp))"
    )
    p.add_argument("--batch", type=int, default=4, help="sequences per dp rank per step")
    p.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: the preset's max)"
    )
    p.add_argument("--schedule", default="1f1b", choices=[s.value for s in PipelineSchedule])
    p.add_argument("--microbatches", type=int, default=None, help="per step when pp > 1")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with tp > 1)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument(
        "--offload",
        action="store_true",
        help="FSDP2 CPU offload: parameters, gradients and AdamW state in host memory",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 mixed precision (default: on with CUDA)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--profile-steps", type=int, default=3, help="profiled steps for the split (0: skip)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    return p.parse_args()


def comm_split(trainer: Trainer, batches: list, device: torch.device, step0: int) -> dict:
    """Profile ``len(batches)`` steps; return per-step compute and communication seconds."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for i, (x, y) in enumerate(batches):
            trainer.step(step0 + i, x, y)
    wall = (time.perf_counter() - t0) / len(batches)
    comm = compute = a2a = 0.0
    for evt in prof.key_averages():
        name = evt.key.lower()
        is_comm = any(m in name for m in COMM_MARKERS)
        is_a2a = any(m in name for m in ALL_TO_ALL_MARKERS)
        if device.type == "cuda":
            # Kernel events only: CPU ops also carry the device time of the
            # kernels they launched, which would count each kernel twice.
            if evt.device_type != DeviceType.CUDA:
                continue
            t = evt.self_device_time_total / 1e6  # us -> s
            if is_comm:
                comm += t
                a2a += t if is_a2a else 0.0
            else:
                compute += t
        elif is_comm:
            comm += evt.self_cpu_time_total / 1e6
            a2a += evt.self_cpu_time_total / 1e6 if is_a2a else 0.0
    n = len(batches)
    if device.type != "cuda":
        compute = max(0.0, wall * n - comm)
    return {
        "profiled_step_s": wall,
        "compute_s": compute / n,
        "comm_s": comm / n,
        "all_to_all_s": a2a / n,
        # Against the profiled steps' own wall time (the profiler slows steps a little).
        "exposed_s": max(0.0, wall - compute / n),
    }


def main() -> None:
    args = parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = "cuda" if use_cuda else "cpu"
    if dev == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp is None:
        layout = ParallelLayout.for_ranks(world, pp=args.pp, tp=args.tp, cp=args.cp)
    else:
        layout = ParallelLayout(pp=args.pp, dp=args.dp, cp=args.cp, tp=args.tp)
    if not dist.is_initialized():
        if dev == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cuda:nccl,cpu:gloo" if dev == "cuda" else "gloo")
    mesh = build_site_mesh(layout, dev)
    cfg = preset(args.preset)
    if args.layers is not None:
        cfg.n_layers = args.layers
    seq = args.seq or cfg.max_seq_len
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    bf16 = use_cuda if args.bf16 is None else args.bf16
    parallel = ParallelConfig(
        schedule=args.schedule,
        microbatches=args.microbatches,
        sequence_parallel=args.sp,
        activation_checkpoint=args.ac,
        compile=args.compile,
        mixed_precision=bf16,
        offload=args.offload,
        expert_parallel=args.ep,
    )
    parallel.check(layout, cfg, batch_size=args.batch, seq_len=seq)
    with torch.device("meta"):
        flops_per_token = Transformer(cfg).flops_per_token(seq)
    total = args.warmup + args.steps + args.profile_steps
    trainer = Trainer(
        build_model(cfg, seed=0),
        mesh,
        TrainConfig(lr=1e-4, warmup_steps=1, total_steps=total),
        parallel=parallel,
    )
    # Random tokens, one stream per dp rank (tp/pp ranks of a replica share it):
    # throughput does not depend on the text.
    gen = torch.Generator().manual_seed(trainer.coordinate[1])
    batches = [
        (t[:, :-1].contiguous(), t[:, 1:].contiguous())
        for t in (
            torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=gen) for _ in range(4)
        )
    ]
    for s in range(args.warmup):
        trainer.step(s, *batches[s % len(batches)])
    times, losses = [], []
    for s in range(args.steps):
        stats = trainer.step(args.warmup + s, *batches[s % len(batches)])
        times.append(stats.compute_s + stats.sync_s)
        losses.append(stats.loss)
    step_s = statistics.median(times)
    site_tokens = args.batch * seq * layout.dp
    tokens_per_s = site_tokens / step_s
    device = trainer.device
    peak = device_peak_flops(device)
    result = {
        "preset": args.preset,
        "params": sum(p.numel() for p in trainer.parameters()) if layout.pp == 1 else None,
        "layout": {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp},
        "parallel": {
            "schedule": args.schedule if layout.pp > 1 else None,
            "microbatches": parallel.num_microbatches(layout.pp) if layout.pp > 1 else None,
            "sequence_parallel": args.sp,
            "activation_checkpoint": args.ac,
            "compile": args.compile,
            "bf16": bf16,
            "offload": args.offload,
            "expert_parallel": args.ep,
        },
        "batch_per_dp_rank": args.batch,
        "seq_len": seq,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "world_size": layout.world_size,
        "step_s": step_s,
        "step_s_min": min(times),
        "tokens_per_step": site_tokens,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak,
        "mfu": mfu(tokens_per_s, flops_per_token, peak, layout.world_size),
        "loss_last": losses[-1],
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if use_cuda else None,
        # Linux reports ru_maxrss in KiB: the host memory offload moves the state into.
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if args.profile_steps > 0:
        prof = [batches[s % len(batches)] for s in range(args.profile_steps)]
        split = comm_split(trainer, prof, device, args.warmup + args.steps)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, split)
        result |= split | {"split_by_rank": every}
    finish_ranks(result, args.json, print_table)


def print_table(r: dict) -> None:
    lay = r["layout"]
    print(
        f"site_step: {r['preset']} on {r['world_size']} x {r['device']}, "
        f"pp={lay['pp']} dp={lay['dp']} cp={lay['cp']} tp={lay['tp']}, {r['parallel']}"
    )
    rows = [
        ("step time (median)", f"{r['step_s'] * 1e3:.1f} ms"),
        ("tokens/step", f"{r['tokens_per_step']:,}"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
        (
            "MFU",
            f"{100 * r['mfu']:.1f} %  (peak {r['peak_flops_per_device'] / 1e12:g} TFLOP/s/device)",
        ),
    ]
    if "compute_s" in r:
        rows += [
            ("compute / step", f"{r['compute_s'] * 1e3:.1f} ms"),
            ("intra-site comm / step", f"{r['comm_s'] * 1e3:.1f} ms (kernel time, may overlap)"),
            ("of it all-to-all", f"{r['all_to_all_s'] * 1e3:.1f} ms"),
            ("exposed (step - compute)", f"{r['exposed_s'] * 1e3:.1f} ms"),
        ]
    if r["max_memory_gib"] is not None:
        rows.append(("peak memory", f"{r['max_memory_gib']:.1f} GiB"))
    rows.append(("host peak (rank 0)", f"{r['host_peak_gib']:.1f} GiB"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
    # As deploy/rank/program.py does: everything is written and the process group destroyed, so
    # skip the interpreter's teardown of torch's C++ state. On a loaded 2-core machine it
    # aborted 1 run in 10-20 *after* destroy_process_group ("terminate called without an
    # active exception": a thread still joinable at static destruction), failing a case
    # whose results were already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
