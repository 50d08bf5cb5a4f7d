"""A round across an emulated link that black-holes one flow each way, with the bulk
frames' deadlines and without: prints a table, writes JSON (issue 32, item 2).

Two sites in this process (real lanes, real relay), ``--connections`` bulk connections
each way over one emulated link. After a warm-up round has dialled every connection, the
link holds the first bulk flow each way (``flow_stall``, for ``--stall-s``) and one round
of ``--mib`` MiB a site runs: with the deadlines (``inter/data/transport/bulk_peer.py``: the stalled
connection is left and its frames go on a new one) and with them switched off (the round
waits for the flow, as before them, or fails at ``--timeout-s``). A round on the clean
link is the reference. Every round must end exact and identical at both sites.

    python3 benchmarks/stalled_flow.py --gbit 0.4 --rtt-ms 2 --mib 16 --stall-s 20 \\
        --json runs/stalled_flow.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from isthmus.inter.data.round.allreduce import CrossSiteAllReduce
from isthmus.inter.data.transport import flow_clock
from isthmus.sim import LinkSpec
from isthmus.sim.impairments.flow_stall import FlowStall

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lanes import two_sites_over  # noqa: E402 (tests/, put on sys.path above)

CHUNK = 1 << 20


def one_round(ars: list[CrossSiteAllReduce], tensors: list[torch.Tensor], step: int) -> dict:
    """Both sites all-reduce their tensor at once; wall time, stalls, and the check."""
    want = tensors[0] + tensors[1]
    out: list[object] = [None, None]

    def site(s: int) -> None:
        try:
            out[s] = ars[s].allreduce([tensors[s]], step, 0, False)
        except Exception as exc:  # noqa: BLE001 (a failed round is a row of the table)
            out[s] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=site, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    failed = [str(r) for r in out if isinstance(r, Exception)]
    return {
        "wall_s": wall,
        "failed": failed[0] if failed else "",
        "stalled_flows": sum(getattr(r, "stalled_flows", 0) for r in out),
        "exact": not failed and all(torch.equal(t, want) for t in tensors),
    }


def run(args: argparse.Namespace, case: str) -> dict:
    """One case on a fresh pair of sites: ``clean``, ``deadlines`` or ``no deadlines``."""
    floor = flow_clock.STALL_FLOOR_S
    # "no deadlines": never due, the connection waits as it did before them.
    flow_clock.STALL_FLOOR_S = math.inf if case == "no deadlines" else args.floor_s
    try:
        spec = LinkSpec.symmetric(latency_s=args.rtt_ms / 2000, bandwidth_bps=args.gbit * 1e9)
        with two_sites_over(spec, CHUNK, args.connections, args.timeout_s) as (ars, _, link):
            g = torch.Generator().manual_seed(0)
            warm = [torch.randn(4 * CHUNK // 4, generator=g) for _ in range(2)]
            assert one_round(ars, warm, 0)["exact"], "the warm-up round failed"
            if case != "clean":
                # min_bytes: a bulk flow's frame, never a gRPC channel's few bytes.
                stall = (FlowStall(count=1, duration_s=args.stall_s, min_bytes=1 << 16),)
                link.set_impairments(a_to_b=stall, b_to_a=stall)
            n = int(args.mib * (1 << 20)) // 4
            tensors = [torch.randn(n, generator=g) for _ in range(2)]
            row = one_round(ars, tensors, 1)
            stats = link.stats()
            row["link_stalled_flows"] = sum(d.get("stalled_flows", 0) for d in stats.values())
    finally:
        flow_clock.STALL_FLOOR_S = floor
    return {"case": case, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbit", type=float, default=0.4, help="link Gbit/s each way")
    parser.add_argument("--rtt-ms", type=float, default=2.0, help="round-trip time, ms")
    parser.add_argument("--mib", type=float, default=16.0, help="MiB of fp32 a site")
    parser.add_argument("--connections", type=int, default=4, help="bulk connections each way")
    parser.add_argument("--stall-s", type=float, default=20.0, help="how long a flow is held")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the round's timeout")
    parser.add_argument(
        "--floor-s",
        type=float,
        default=flow_clock.STALL_FLOOR_S,
        help="the deadlines' floor past a frame's expected time (flow_clock.STALL_FLOOR_S)",
    )
    parser.add_argument("--json", default="", help="where the results go")
    args = parser.parse_args(argv)
    if not (args.gbit > 0 and args.mib > 0 and args.stall_s > 0 and args.floor_s > 0):
        parser.error("--gbit, --mib, --stall-s and --floor-s must be > 0")
    if args.connections < 1:
        parser.error("--connections must be >= 1")
    os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (gRPC reads lowercase)
    rows = [run(args, case) for case in ("clean", "deadlines", "no deadlines")]
    print(f"{'case':<14}{'wall s':>8}{'stalled (lanes)':>17}{'held (link)':>13}  exact  failed")
    for r in rows:
        print(
            f"{r['case']:<14}{r['wall_s']:>8.2f}{r['stalled_flows']:>17}"
            f"{r['link_stalled_flows']:>13}  {'yes' if r['exact'] else 'NO ':<5}  {r['failed'][:60]}"
        )
    if args.json:
        meta = {"args": vars(args), "host": platform.node(), "cores": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0 if all(r["exact"] for r in rows[:2]) else 1


if __name__ == "__main__":
    sys.exit(main())
