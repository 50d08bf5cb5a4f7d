"""Mixture of experts against dense, one site: step time, tokens/s and MFU by active
parameters, for each preset and each MoE implementation, in one run (issue 36).

Every device of the host is one rank (dp = devices; a mixture of experts splits its
experts over all of them, ep = devices); on CPU, one rank. ``--impl loop,grouped`` runs
issue 17's path (counts read to the host in every layer, the experts one after another)
and the device-side grouped GEMM path in the same processes, one after the other.
``--capacity-factor 0,1.25`` runs each MoE path dropless and with that capacity; with a
capacity and ep > 1, ``grouped`` exchanges static slots (no host read) and
``host-splits`` the kept copies alone (one host read a layer):

    python benchmarks/moe_step.py --json runs/moe_step.json               # every GPU
    python benchmarks/moe_step.py --impl loop,grouped --nproc 1           # one GPU
    python benchmarks/moe_step.py --impl host-splits,grouped --capacity-factor 0,1.25
    python benchmarks/moe_step.py --device cpu --preset moe-tiny --steps 2   # smoke

MFU uses ``Transformer.flops_per_token`` (6N + 12 L d T, N the active parameters) and
``isthmus.intra.flops``' device peak. ``host reads`` counts ``Tensor.tolist`` and
``Tensor.item`` calls in one step (each waits for the device; the trainer's own
loss all-reduce is one).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import finish_ranks, parser

from isthmus.intra.flops import device_peak_flops, mfu
from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model import Transformer, build_model
from isthmus.intra.model_config import preset
from isthmus.intra.moe import set_moe_impl
from isthmus.intra.moe_dispatch import MOE_IMPLS
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--preset", default="125m,moe-125m", help="comma-separated presets")
    p.add_argument(
        "--impl", default="grouped", help=f"comma-separated MoE paths, of {list(MOE_IMPLS)}"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--nproc", type=int, default=0, help="ranks (0: every GPU, or 1 on CPU)")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank (0: 8 GPU, 2 CPU)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: 2048 GPU, 64 CPU)")
    p.add_argument(
        "--capacity-factor", default="0", help="comma-separated, for MoE presets; 0 dropless"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    impls = args.impl.split(",")
    if unknown := [i for i in impls if i not in MOE_IMPLS]:
        p.error(f"--impl {','.join(unknown)}: choose from {list(MOE_IMPLS)}")
    args.impls = impls
    try:
        args.capacity_factors = [float(f) for f in args.capacity_factor.split(",")]
    except ValueError:
        p.error(f"--capacity-factor {args.capacity_factor}: comma-separated numbers >= 0")
    if any(not 0 <= f < float("inf") for f in args.capacity_factors):
        p.error(f"--capacity-factor {args.capacity_factor}: comma-separated numbers >= 0")
    args.presets = args.preset.split(",")
    for name in args.presets:
        try:
            preset(name)
        except ValueError as exc:
            p.error(f"--preset: {exc}")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if use_cuda else "cpu"
    args.nproc = args.nproc or (torch.cuda.device_count() if use_cuda else 1)
    args.batch = args.batch or (8 if use_cuda else 2)
    args.seq = args.seq or (2048 if use_cuda else 64)
    return args


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list[int]]:
    """Count ``Tensor.tolist`` and ``Tensor.item`` calls inside the block."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def wrap(name: str):
        def counted(self: torch.Tensor, *a, **k):
            count[0] += 1
            return originals[name](self, *a, **k)

        return counted

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def one_case(args: argparse.Namespace, name: str, impl: str | None, factor: float) -> dict:
    """Build, warm up and time one preset (one MoE path, one capacity factor) on this
    rank's site."""
    cfg = preset(name)
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq)
    world = dist.get_world_size()
    moe = bool(cfg.n_experts)
    cfg.capacity_factor = factor if moe else 0.0
    layout = ParallelLayout(dp=world)
    parallel = ParallelConfig(
        compile=args.compile,
        mixed_precision=args.device == "cuda",
        expert_parallel=world if moe else 1,
    )
    parallel.check(layout, cfg, batch_size=args.batch, seq_len=args.seq)
    mesh = build_site_mesh(layout, args.device)
    model = build_model(cfg, seed=0)
    if impl is not None:
        set_moe_impl(model, impl)
    total = args.warmup + args.steps + 1
    trainer = Trainer(
        model, mesh, TrainConfig(lr=1e-4, warmup_steps=1, total_steps=total), parallel=parallel
    )
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [
        (t[:, :-1].contiguous(), t[:, 1:].contiguous())
        for t in (
            torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
            for _ in range(4)
        )
    ]
    for s in range(args.warmup):
        trainer.step(s, *batches[s % 4])
    times = []
    for s in range(args.warmup, args.warmup + args.steps):
        stats = trainer.step(s, *batches[s % 4])
        times.append(stats.compute_s + stats.sync_s)
    with counting_host_reads() as reads:
        stats = trainer.step(total - 1, *batches[0])
    with torch.device("meta"):
        flops_per_token = Transformer(cfg).flops_per_token(args.seq)
    step_s = statistics.median(times)
    tokens = args.batch * args.seq * world
    peak = device_peak_flops(trainer.device)
    result = {
        "preset": name,
        "impl": impl if moe else None,
        "capacity_factor": cfg.capacity_factor if moe else None,
        "dp": world,
        "ep": world if moe else 1,
        "active_params": cfg.num_params - cfg.inactive_params,
        "total_params": cfg.num_params,
        "step_s": step_s,
        "step_s_min": min(times),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "flops_per_token": flops_per_token,
        "mfu": mfu(tokens / step_s, flops_per_token, peak, world),
        "host_reads_per_step": reads[0],
        "moe_load_ratio": stats.moe_load_ratio,
        "moe_dropped": stats.moe_dropped,
        "loss_last": stats.loss,
        "max_memory_gib": (
            torch.cuda.max_memory_allocated(trainer.device) / 2**30
            if args.device == "cuda"
            else None
        ),
    }
    del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def run_rank(rank: int, args: argparse.Namespace, store: str) -> None:
    """One rank: every case in turn; rank 0 prints the table and writes the JSON."""
    if args.device == "cuda":
        # build_site_mesh picks the rank's GPU from LOCAL_RANK (torchrun's), which
        # mp.spawn does not set: without it every rank would take GPU 0.
        os.environ["LOCAL_RANK"] = str(rank)
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(
        "cuda:nccl,cpu:gloo" if args.device == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.nproc,
    )
    cases = [
        (name, impl, factor)
        for name in args.presets
        for factor in (args.capacity_factors if preset(name).n_experts else [0.0])
        for impl in (args.impls if preset(name).n_experts else [None])
    ]
    results = [one_case(args, *case) for case in cases]
    report = {
        # The rank's own GPU (rank 0's is GPU 0): asking for another would open it.
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "nproc": args.nproc,
        "batch_per_rank": args.batch,
        "seq_len": args.seq,
        "capacity_factors": args.capacity_factors,
        "compile": args.compile,
        "torch": torch.__version__,
        "results": results,
    }
    finish_ranks(report, args.json, print_table)


def print_table(report: dict) -> None:
    results = report["results"]
    dense = next((r for r in results if r["impl"] is None), None)
    print(
        f"moe_step: {report['nproc']} x {report['device']}, batch {report['batch_per_rank']} x "
        f"{report['seq_len']} per rank, compile {report['compile']}, torch {report['torch']}"
    )
    header = (
        f"{'preset':<10} {'impl':<11} {'capacity':>8} {'layout':<11} {'step ms':>9} "
        f"{'tokens/s':>11} {'MFU':>7} {'step/dense':>10} {'MFU/dense':>9} {'host reads':>10}"
    )
    print(header)
    for r in results:
        layout = f"dp {r['dp']}" + (f", ep {r['ep']}" if r["impl"] else "")
        versus = ("", "")
        if dense is not None:
            versus = (f"{r['step_s'] / dense['step_s']:.2f}x", f"{r['mfu'] / dense['mfu']:.2f}x")
        factor = r["capacity_factor"]
        capacity = "-" if factor is None else f"{factor:g}" if factor else "dropless"
        print(
            f"{r['preset']:<10} {r['impl'] or '-':<11} {capacity:>8} {layout:<11} "
            f"{r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>11,.0f} {100 * r['mfu']:>6.1f}% "
            f"{versus[0]:>10} {versus[1]:>9} {r['host_reads_per_step']:>10}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        if args.nproc == 1:
            run_rank(0, args, store)
        else:
            mp.spawn(run_rank, args=(args, store), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
    # As benchmarks/site_step.py: results are written and the process groups destroyed;
    # skip the interpreter's teardown of torch's C++ state (it can abort at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
