"""`isthmus bench allreduce`: the cross-site all-reduce over emulated links.

Each case of the grid starts one process per site (`isthmus.inter.data.bench`) whose
lanes cross the WAN emulator (`isthmus.sim.RelayServer`), as `isthmus local` wires them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.commands import add_command, add_group
from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.config.run_sections import MAX_SYNC_CHUNK_BYTES
from isthmus.inter.data import connections_for_link, parse_codec_spec, sync_chunk_bytes

if TYPE_CHECKING:
    from isthmus.inter.data import bench

FULL = {
    "sites": "2,3",
    "rtt_ms": "0.1,10,50",
    "gbit": "1,10",
    "mib": "64,256",
    "codec": "raw,raw+shuffle+zstd:1,bf16,bf16+shuffle+zstd:1,int8,int8+zstd:1",
}
QUICK = {"sites": "2", "rtt_ms": "1", "gbit": "1", "mib": "2", "codec": "raw,int8+zstd:1"}


@contextlib.contextmanager
def emulated_links(
    num_sites: int,
    rtt_s: float,
    bandwidth_bps: float,
    links_per_pair: int = 1,
    *,
    per_flow_bps: float = 0.0,
    processes: bool = False,
    queue_bytes: int | None = None,
) -> Iterator[dict[tuple[int, int], list[str]]]:
    """``links_per_pair`` emulated links between each pair of sites (each TCP flow held
    to ``per_flow_bps``, 0 = no cap; each direction pumped by a process of its own with
    ``processes``; a router queue of ``queue_bytes``, None = the emulator's default);
    yields {(i, j): the proxy URLs i dials j by, one per link}."""
    from isthmus.sim import LinkSpec, RelayServer
    from isthmus.sim.spec import DEFAULT_QUEUE_BYTES

    if queue_bytes is None:
        queue_bytes = DEFAULT_QUEUE_BYTES

    # gRPC skips a proxy for hosts in no_proxy; name none so lanes cross the link.
    os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (gRPC reads lowercase)
    relay = RelayServer(processes=processes).start()
    try:
        spec = LinkSpec.symmetric(
            latency_s=rtt_s / 2,
            bandwidth_bps=bandwidth_bps,
            per_flow_bps=per_flow_bps,
            queue_bytes=queue_bytes,
        )
        proxies: dict[tuple[int, int], list[str]] = {}
        for i in range(num_sites):
            for j in range(i + 1, num_sites):
                for k in range(links_per_pair):
                    link = relay.add_link(f"site{i}-site{j}" + (f"-{k}" if k else ""), spec)
                    host, port = link.add_proxy(initiator="a")
                    proxies.setdefault((i, j), []).append(f"http://{host}:{port}")
                    host, port = link.add_proxy(initiator="b")
                    proxies.setdefault((j, i), []).append(f"http://{host}:{port}")
        yield proxies
    finally:
        relay.close()


@contextlib.contextmanager
def direct_links(
    num_sites: int, rtt_s: float, bandwidth_bps: float, links_per_pair: int = 1
) -> Iterator[dict[tuple[int, int], list[str]]]:
    """No emulator: lanes dial each other on loopback, so a case measures the lanes'
    own limit (CPU, gRPC, codec) rather than a link's; RTT and bandwidth are unused."""
    yield {}


def _floats(text: str, flag: str, low: float) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} expects comma-separated numbers, got {text!r}") from None
    if not values or any(v < low for v in values):
        raise ConfigError(f"{flag} values must be >= {low:g}, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (shared with `benchmarks/allreduce.py`)."""
    add = parser.add_argument
    add("--sites", help=f"site counts, comma-separated (default {FULL['sites']})")
    add("--rtt-ms", help=f"round-trip times in ms (default {FULL['rtt_ms']})")
    add("--gbit", help=f"link bandwidths in Gbit/s per direction (default {FULL['gbit']})")
    add("--mib", help=f"tensor sizes per site in MiB (default {FULL['mib']})")
    add("--codec", help=f"codec specs (default {FULL['codec']})")
    add("--quick", action="store_true", help="a small grid for tests: " + str(QUICK))
    add("--chunk-kib", type=int, default=0, help="chunk size; 0 = from the link's BDP")
    add(
        "--connections",
        type=int,
        default=0,
        help="TCP connections per peer lane; 0 = as training sizes them from the link",
    )
    add(
        "--per-flow-mbit",
        type=float,
        default=0.0,
        help="the emulated link holds each TCP connection to this many Mbit/s (0 = no cap)",
    )
    add(
        "--relay-processes",
        action="store_true",
        help="the emulator pumps each link direction in "
        "a process of its own (for links past ~15 Gbit/s loaded both ways: one relay process moves "
        "~34 Gbit/s summed)",
    )
    add(
        "--queue-kib",
        type=int,
        default=-1,
        help="the emulated link's router queue beyond its "
        "bandwidth-delay product, KiB (-1 = the emulator's default, as `wan.queue_kib` of a "
        "topology)",
    )
    add("--workers", type=int, default=0, help="encode/decode threads per lane; 0 = auto")
    _add_step_arguments(parser)


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of each case's lanes and steps (``add_arguments``'s second half)."""
    add = parser.add_argument
    add(
        "--tls",
        action="store_true",
        help="lanes run mutual TLS, as a secure job's (certificates made for the run)",
    )
    add(
        "--lanes",
        type=int,
        default=1,
        help="ranks (lanes, processes) per site, each all-reducing "
        "an equal slice of the site's tensor over the site's shared links",
    )
    add(
        "--links",
        type=int,
        default=1,
        help="emulated links between each pair of sites, each of "
        "--gbit; lane k crosses link k mod LINKS, as each host of a site has an uplink of its own "
        "(must divide --lanes)",
    )
    add(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where each lane's slice lives; "
        "cuda puts each lane on a GPU of its own, so rounds decode, sum and encode there as in "
        "training",
    )
    add(
        "--groups",
        type=int,
        default=1,
        help="split each slice into this many groups started one "
        "after another, as backward starts FSDP groups (1 = one plain all-reduce)",
    )
    add("--in-flight", type=int, default=4, help="rounds in flight with --groups > 1")
    add(
        "--load-ms",
        type=float,
        default=0.0,
        help="compute per step in ms, spread over the groups "
        "(matrix products on the lane's GPU or CPU before each group starts); the table's "
        "'exposed' column is then how long the step waited for the sync after its "
        "compute",
    )
    add("--repeats", type=int, default=1, help="timed steps per case; the median is shown")
    add(
        "--warmup",
        type=int,
        default=2,
        help="full-size untimed steps first, as training's steady "
        "state follows its first steps (a lane's first two pay first-use allocations; 0 times "
        "them)",
    )
    add("--timeout-s", type=float, default=600.0, help="limit on one all-reduce")
    add(
        "--direct",
        action="store_true",
        help="no emulated link: lanes talk on loopback, to tell "
        "the lanes' own limit from the link's (efficiency is then still against the "
        "--gbit/--rtt-ms bound)",
    )
    add("--json", default="allreduce-bench.json", help="where the results go")
    add("--no-throughput", action="store_true", help="skip the per-core codec speeds")


def cases_from_args(args: argparse.Namespace) -> list[bench.BenchCase]:
    """The grid the flags select; raises ConfigError on bad input."""
    from isthmus.inter.data import bench  # torch: not imported by every `isthmus` command

    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) or base[k] for k in base}
    sites = [int(v) for v in _floats(pick["sites"], "--sites", 2)]
    rtts = _floats(pick["rtt_ms"], "--rtt-ms", 0)
    gbits = _floats(pick["gbit"], "--gbit", 1e-3)
    mibs = _floats(pick["mib"], "--mib", 1 / 64)
    codecs = [c.strip() for c in pick["codec"].split(",") if c.strip()]
    for spec in codecs:
        try:
            parse_codec_spec(spec)
        except ValueError as exc:
            raise ConfigError(f"--codec: {exc}") from None
    chunk = args.chunk_kib * 1024
    if chunk and not 4096 <= chunk <= MAX_SYNC_CHUNK_BYTES:
        raise ConfigError(
            f"--chunk-kib must be 4..{MAX_SYNC_CHUNK_BYTES // 1024}, got {args.chunk_kib}"
        )
    if not 0 <= args.connections <= 16:
        raise ConfigError(f"--connections must be in 0..16, got {args.connections}")
    if args.per_flow_mbit < 0:
        raise ConfigError(f"--per-flow-mbit must be >= 0, got {args.per_flow_mbit}")
    if args.queue_kib < -1:
        raise ConfigError(f"--queue-kib must be >= 0 (-1 = default), got {args.queue_kib}")
    if not 1 <= args.lanes <= 64:
        raise ConfigError(f"--lanes must be in 1..64, got {args.lanes}")
    if args.links < 1 or args.lanes % args.links:
        raise ConfigError(f"--links must divide --lanes ({args.lanes}), got {args.links}")
    if args.links > 1 and args.direct:
        raise ConfigError("--links needs emulated links: drop --direct or --links")
    if args.groups < 1 or args.in_flight < 1 or args.repeats < 1 or args.load_ms < 0:
        raise ConfigError("--groups, --in-flight and --repeats must be >= 1, --load-ms >= 0")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible")
    if args.workers < 0 or args.timeout_s <= 0:
        raise ConfigError("--workers must be >= 0 and --timeout-s > 0")
    same = ("timeout_s", "lanes", "links", "device", "groups", "in_flight", "load_ms", "repeats")
    every_case = {name: getattr(args, name) for name in (*same, "warmup")}
    return [
        bench.BenchCase(
            sites=s,
            rtt_ms=rtt,
            gbit=g,
            mib=mib,
            codec=codec,
            # As training sizes them (the CUDA floor included), so the figures are
            # the ones training sees.
            chunk_bytes=chunk
            or sync_chunk_bytes(g * 1e9, rtt / 1000, cuda=args.device == "cuda", bulk=True),
            connections=args.connections
            or connections_for_link(g * 1e9, rtt / 1000, args.per_flow_mbit * 1e6),
            workers=args.workers or None,
            **every_case,
        )
        for s in sites
        for rtt in rtts
        for g in gbits
        for mib in mibs
        for codec in codecs
    ]


def cmd_bench_allreduce(args: argparse.Namespace) -> int:
    """the cross-site all-reduce, one process per site, over emulated links

    Time the cross-site all-reduce for every point of a grid (sites x RTT x bandwidth x
    tensor size x codec), one process per site, lanes through the WAN emulator. Efficiency
    = (2(S-1)/S x tensor bytes / bandwidth + RTT) / wall time: above 1 means the codec
    beats an ideal uncompressed all-reduce. The per-core codec speeds and the cores each
    link speed needs come first."""
    from isthmus.inter.data import bench

    cases = cases_from_args(args)
    out: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "codec_throughput": [],
        "cases": [],
    }
    if not args.no_throughput:
        mib = 1.0 if args.quick else 4.0
        specs = list(dict.fromkeys(c.codec for c in cases))
        out["codec_throughput"] = [bench.codec_throughput(spec, mib=mib) for spec in specs]
        gbits = sorted({c.gbit for c in cases})
        print(bench.format_throughput(out["codec_throughput"], gbits), flush=True)
        print(flush=True)
    certs = tempfile.TemporaryDirectory(prefix="isthmus-bench-certs-") if args.tls else None
    if certs is not None:
        from isthmus.deploy.commands.certs import write_certs

        write_certs(certs.name, [f"site{i}" for i in range(max(c.sites for c in cases))])
        cases = [dataclasses.replace(c, certs_dir=certs.name) for c in cases]
    try:
        _run_cases(args, cases, out)
    finally:
        if certs is not None:
            certs.cleanup()
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


def _run_cases(args: argparse.Namespace, cases: list, out: dict) -> None:
    from isthmus.inter.data import bench

    for case in cases:
        links = functools.partial(
            emulated_links,
            per_flow_bps=args.per_flow_mbit * 1e6,
            processes=args.relay_processes,
            queue_bytes=None if args.queue_kib < 0 else args.queue_kib * 1024,
        )
        result = bench.run_case(case, direct_links if args.direct else links)
        result["direct"] = bool(args.direct)
        result["tls"] = bool(case.certs_dir)
        result.pop("certs_dir", None)  # a temporary folder, gone with the run
        out["cases"].append(result)
        # One line per case as it finishes: a full grid takes a while.
        header, line = bench.format_results([result]).splitlines()
        if len(out["cases"]) == 1:
            print(header)
        print(line, flush=True)


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """benchmark the data plane

    Benchmarks of isthmus's data plane over emulated links."""
    kinds = add_group(sub, formatter, "bench", register, "bench", "BENCHMARK")
    add_arguments(add_command(kinds, formatter, "allreduce", cmd_bench_allreduce))
