"""Flat gloo all-reduce vs the isthmus cross-site sync, on the same emulated link.

Two sites, each a network namespace with R rank processes, joined by one emulated
link in transparent mode (`isthmus.sim.transparent`; needs root and iptables). For
each tensor size, all 2R ranks sum the same tensors two ways:

- flat: one torch.distributed gloo world of 2R ranks (MASTER_ADDR in site 0's
  namespace); gloo's cross-site TCP goes through the relay like any program's;
- isthmus: each site reduce-scatters inside (its own gloo world, on loopback), the
  rank at each coordinate all-reduces its shard with the same rank of the other site
  (`CrossSiteAllReduce` over lanes that dial the peer's namespace address through
  the relay), then each site all-gathers inside.

Each timed all-reduce starts right after a barrier that spans both sites and ends
when its slowest rank is done; the figure is the median of `--repeats`. Values are
small integers, so every sum is exact in any order and both results are checked.

    sudo python3 benchmarks/side_by_side.py [--sizes-mib 16 64] [--ranks-per-site 1]
        [--bandwidth-mbit 1000] [--distance-km 1000] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import date, timedelta
from pathlib import Path

from _common import parser

from isthmus.sim import LinkSpec
from isthmus.sim.transparent import TransparentWan

MIB = 1 << 20
FLAT_PORT = 29500  # every namespace is fresh, so fixed ports are free
SITE_PORT = 29501
LANE_PORT = 29600  # + rank
MODES = ("flat", "isthmus")


def values(rank: int, numel: int, seed: int):
    """The tensor a global rank contributes: integers in [-64, 64), exact when summed."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-64, 64, (numel,), generator=g).to(torch.float32)


# -- worker (one rank, inside its site's namespace) ---------------------------------


def die_with_parent() -> None:
    """SIGKILL this worker when the benchmark dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    die_with_parent()
    torch.set_num_threads(args.threads)
    site, rank, ranks = args.site, args.rank, args.ranks_per_site
    global_rank = site * ranks + rank
    timeout = timedelta(seconds=args.timeout_s)
    flat = args.worker == "flat"
    os.environ.update(
        MASTER_ADDR=args.addresses[0] if flat else "127.0.0.1",
        MASTER_PORT=str(FLAT_PORT if flat else SITE_PORT),
        # gloo listens on, and announces, this interface's address.
        GLOO_SOCKET_IFNAME="isthmus0" if flat else "lo",
    )
    world = 2 * ranks if flat else ranks
    dist.init_process_group("gloo", rank=global_rank if flat else rank, world_size=world, timeout=timeout)  # fmt: skip
    cross = None if flat else cross_site(args)
    step = 0

    def barrier() -> None:  # across both sites, untimed
        nonlocal step
        dist.barrier()
        if cross is not None:
            step += 1
            cross.allreduce([torch.zeros(1)], step=step, group=1, average=False)
            dist.barrier()

    times: dict[str, list[float]] = {}
    for size in args.sizes_mib:
        numel = int(size * MIB) // 4 // ranks * ranks
        mine = values(global_rank, numel, args.seed)
        expected = sum(values(r, numel, args.seed) for r in range(2 * ranks))
        shard = torch.empty(numel // ranks)
        out = times[str(size)] = []
        for i in range(args.warmup + args.repeats):
            t = mine.clone()
            barrier()
            start = time.perf_counter()
            if flat:
                dist.all_reduce(t)
            else:
                step += 1
                dist.reduce_scatter_tensor(shard, t)
                cross.allreduce([shard], step=step, group=0, average=False)
                dist.all_gather_into_tensor(t, shard)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                out.append(elapsed)
            if not torch.equal(t, expected):
                raise SystemExit(f"{args.worker} site {site} rank {rank}: wrong sum at {size} MiB")
    print(json.dumps({"site": site, "rank": rank, "times": times}), flush=True)
    barrier()
    dist.destroy_process_group()
    if cross is not None:
        for peer in cross.membership.peers().values():
            peer.close()
        cross.server.stop(grace=1.0)


def cross_site(args: argparse.Namespace):
    """This rank's `CrossSiteAllReduce` with the same rank of the other site."""
    from isthmus.inter.data.codecs.chain import make_codec
    from isthmus.inter.data.lane.peer import LanePeer
    from isthmus.inter.data.lane.server import LaneServer
    from isthmus.inter.data.round.allreduce import CrossSiteAllReduce, FixedMembership

    site, chunk = args.site, int(args.chunk_mib * MIB)
    codec = make_codec(args.codec)
    server = LaneServer(
        site_index=site,
        num_sites=2,
        codec=codec.name,
        chunk_bytes=chunk,
        host=args.addresses[site],
        port=LANE_PORT + args.rank,
    )
    # A plain address: the namespace's route and the relay carry it across the link.
    peer = LanePeer(
        f"{args.addresses[1 - site]}:{LANE_PORT + args.rank}",
        chunk_bytes=chunk,
        connections=args.connections,
    )
    return CrossSiteAllReduce(
        membership=FixedMembership(server, {1 - site: peer}),
        codec=codec,
        chunk_bytes=chunk,
        timeout_s=args.timeout_s,
    )


# -- driver (root namespace) ----------------------------------------------------------


def run_mode(mode: str, wan: TransparentWan, args: argparse.Namespace) -> dict[str, list[float]]:
    """Run one mode's 2R workers; returns size -> per-repeat times of the slowest rank."""
    ranks = args.ranks_per_site
    threads = max(1, (os.cpu_count() or 1) // (2 * ranks))
    addresses = [s.address for s in wan.sites]
    procs = []
    for site in range(2):
        for rank in range(ranks):
            cmd = [
                *wan.sites[site].exec_prefix,
                sys.executable, str(Path(__file__).resolve()), "--worker", mode,
                "--site", str(site), "--rank", str(rank), "--threads", str(threads),
                "--addresses", *addresses, *worker_flags(args),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "no_grpc_proxy": "none.invalid"}
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))  # fmt: skip
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=args.timeout_s * 4)
            if p.returncode != 0:
                raise SystemExit(f"{mode} worker failed (exit {p.returncode}):\n{stderr[-3000:]}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {
        size: [max(r["times"][size][i] for r in results) for i in range(args.repeats)]
        for size in results[0]["times"]
    }


def worker_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--sizes-mib", *map(str, args.sizes_mib), "--ranks-per-site", str(args.ranks_per_site),
        "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--seed", str(args.seed),
        "--chunk-mib", str(args.chunk_mib), "--codec", args.codec,
        "--connections", str(args.connections), "--timeout-s", str(args.timeout_s),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add = p.add_argument
    add("--sizes-mib", type=float, nargs="+", default=[16, 64], help="fp32 tensor sizes, MiB")
    add("--ranks-per-site", type=int, default=1, help="R: rank processes per site")
    add("--distance-km", type=float, default=1000.0, help="fiber distance (4.9 us/km one way)")
    add("--bandwidth-mbit", type=float, default=1000.0, help="link bandwidth each way, Mbit/s")
    add("--repeats", type=int, default=3, help="timed all-reduces per size (median reported)")
    add("--warmup", type=int, default=1, help="untimed all-reduces per size first")
    add("--chunk-mib", type=float, default=1.0, help="isthmus lane chunk size, MiB")
    add("--codec", default="raw", help="isthmus codec (raw keeps the bytes equal to flat's)")
    add("--connections", type=int, default=1, help="isthmus lane TCP connections per peer")
    add("--seed", type=int, default=0)
    add("--timeout-s", type=float, default=120.0, help="collective and round timeout")
    add("--job", default="sbs", help="namespace job name (1-8 of [a-z0-9])")
    add("--json", default=None, help="also write the results here")
    add("--quick", action="store_true", help="one 4 MiB size, 2 repeats (a smoke test)")
    add("--worker", choices=MODES, help=argparse.SUPPRESS)
    add("--site", type=int, help=argparse.SUPPRESS)
    add("--rank", type=int, help=argparse.SUPPRESS)
    add("--threads", type=int, default=1, help=argparse.SUPPRESS)
    add("--addresses", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.sizes_mib, args.repeats = [4.0], 2
    if args.ranks_per_site < 1 or args.repeats < 1:
        p.error("--ranks-per-site and --repeats must be >= 1")
    spec = LinkSpec.from_distance(args.distance_km, args.bandwidth_mbit * 1e6)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with TransparentWan(args.job, 2, spec) as wan:
        timings = {mode: run_mode(mode, wan, args) for mode in MODES}
        link_stats = wan.links["site0-site1"].stats()
    rows = []
    print(
        f"2 sites x {args.ranks_per_site} rank(s), {args.distance_km:g} km "
        f"({spec.a_to_b.latency_s * 1e3:.2f} ms one way), {args.bandwidth_mbit:g} Mbit/s, "
        f"codec {args.codec}, median of {args.repeats}"
    )
    print(f"{'size MiB':>9} {'flat s':>9} {'isthmus s':>10} {'flat/isthmus':>13}")
    for size in timings["flat"]:
        flat = statistics.median(timings["flat"][size])
        ours = statistics.median(timings["isthmus"][size])
        rows.append({"size_mib": float(size), "flat_s": flat, "isthmus_s": ours, "ratio": flat / ours})  # fmt: skip
        print(f"{float(size):>9g} {flat:>9.3f} {ours:>10.3f} {flat / ours:>13.2f}")
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "ranks_per_site": args.ranks_per_site,
        "distance_km": args.distance_km,
        "one_way_latency_s": spec.a_to_b.latency_s,
        "bandwidth_mbit": args.bandwidth_mbit,
        "codec": args.codec,
        "repeats": args.repeats,
        "rows": rows,
        "times": timings,
        "link": link_stats,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
