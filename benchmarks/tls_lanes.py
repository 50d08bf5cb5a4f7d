"""Two sites' lanes under mutual TLS on loopback: each transport's own rate.

    python3 benchmarks/tls_lanes.py [--mib 256] [--codec raw,int8] [--connections 2]
        [--transport auto,grpc] [--plain] [--rounds 5] [--json out.json]

``--transport``: ``auto`` (the tree's default under TLS: the bulk port inside TLS since
2026-12-03, ``PushChunks`` calls before), ``bulk`` or ``grpc``; ``--plain`` adds the
bulk port without TLS, for scale.

Both sites run in this process (a thread each, wired by tests/lanes.py's ``lane_pair``),
with the job's certificates made in a temporary folder. GB/s is fp32 tensor a site a second, the median of the rounds after a
warm-up; "cpu s/GB" is the process's CPU per GB of one site's tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from isthmus.deploy.commands.certs import write_certs
from isthmus.inter.security import SiteSecurity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lanes import lane_pair, run_all  # noqa: E402 (tests/, put on sys.path above)


def run_case(
    codec: str, mib: int, connections: int, rounds: int, certs: str, transport: str, tls: bool
) -> dict:
    """Median GB/s and CPU s/GB of ``rounds`` all-reduces of ``mib`` MiB a site."""
    security = [
        SiteSecurity.load(certs, f"site{i}", require_tls=tls, require_token=True) for i in range(2)
    ]
    n = mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(n, generator=g) * 1e-3 for _ in range(2)]
    walls, cpus = [], []
    with lane_pair(
        codec=codec,
        timeout_s=120,
        connections=connections,
        chunk_bytes=4 << 20,
        transport=transport,
        security=security.__getitem__,
    ) as ars:
        for step in range(rounds + 1):  # the first round dials and warms up
            cpu0, t0 = time.process_time(), time.perf_counter()
            res = run_all(
                [lambda s=s, k=step: ars[s].allreduce([data[s]], k, 0, True) for s in (0, 1)],
                timeout=600,
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            bad = [r for r in res if isinstance(r, BaseException)]
            if bad:
                raise RuntimeError(f"{codec}: {bad[0]}")
            if step:
                walls.append(wall)
                cpus.append(cpu)
    gb = n * 4 / 1e9
    wall = statistics.median(walls)
    return {
        "codec": codec,
        "transport": transport,
        "tls": tls,
        "mib": mib,
        "connections": connections,
        "rounds": rounds,
        "gb_s": gb / wall,
        "cpu_s_per_gb": statistics.median(cpus) / gb,
        "identical": bool(torch.equal(data[0].view(torch.int32), data[1].view(torch.int32))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="tensor a site, MiB")
    ap.add_argument("--codec", default="raw,int8", help="codec specs, comma-separated")
    ap.add_argument("--connections", type=int, default=2, help="TCP connections a peer")
    ap.add_argument("--transport", default="auto,grpc", help="auto, bulk, grpc; comma-separated")
    ap.add_argument("--plain", action="store_true", help="also the bulk port without TLS")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after a warm-up)")
    ap.add_argument("--json", default="", help="where the results go")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.connections < 1 or args.rounds < 1:
        ap.error("--mib, --connections and --rounds must be >= 1")
    os.environ.setdefault("no_grpc_proxy", "127.0.0.1")  # loopback, never a proxy
    rows = []
    with tempfile.TemporaryDirectory() as certs:
        write_certs(certs, ["site0", "site1"])
        cases = [(t, True) for t in args.transport.split(",")]
        cases += [("bulk", False)] if args.plain else []
        for codec in args.codec.split(","):
            for transport, tls in cases:
                rows.append(
                    run_case(codec, args.mib, args.connections, args.rounds, certs, transport, tls)
                )
    print("codec      transport  tls    MiB  conns  GB/s  cpu s/GB  same")
    for r in rows:
        print(
            f"{r['codec']:<10} {r['transport']:<9} {'yes' if r['tls'] else 'no':<4} "
            f"{r['mib']:>5} {r['connections']:>6} {r['gb_s']:>5.2f} "
            f"{r['cpu_s_per_gb']:>9.2f}  {'yes' if r['identical'] else 'NO'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "argv": sys.argv[1:]}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
