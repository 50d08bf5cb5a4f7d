"""`isthmus wan netns`: sites as network namespaces joined by emulated links
(docs/transparent.md). Also runnable alone: `python3 -m isthmus.deploy.commands.netns up`.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from isthmus.deploy.commands import add_command, add_group
from isthmus.sim import LinkSpec
from isthmus.sim.control import DEFAULT_ADDRESS, parse_address
from isthmus.sim.netns import DEFAULT_POOL, NetnsError, teardown
from isthmus.sim.transparent import TransparentWan

DEFAULT_JOB = "wan"


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """sites as network namespaces; any TCP program crosses the emulated link

    Transparent mode: each site is a network namespace, and every TCP connection from one
    site to another's address crosses the emulated link. Needs root and iptables."""
    actions = add_group(sub, formatter, "netns", register, "netns_command", "{up,down}")
    up = add_command(actions, formatter, "up", cmd_up)
    add = up.add_argument
    add("--sites", type=int, default=2, help="number of sites")
    add("--distance-km", type=float, default=1000.0, help="fiber distance (~4.9 us per km one way)")
    add(
        "--bandwidth-mbit", type=float, default=1000.0, help="bandwidth each way, Mbit/s (0 = none)"
    )
    add(
        "--per-flow-mbit",
        type=float,
        default=0.0,
        help="most Mbit/s one TCP connection gets each way, as clouds cap a flow (0 = no cap)",
    )
    add("--queue-kib", type=int, default=256, help="buffering beyond the bandwidth-delay product")
    add("--job", default=DEFAULT_JOB, help="job name, 1-8 of [a-z0-9]")
    add("--pool", default=DEFAULT_POOL, help="IPv4 network the sites' /24s come from")
    add(
        "--control",
        default=DEFAULT_ADDRESS,
        metavar="HOST:PORT",
        help="serve the control endpoint of `isthmus wan show/set` here (0: any port)",
    )
    down = add_command(actions, formatter, "down", cmd_down)
    down.add_argument("--job", default=DEFAULT_JOB, help="job name given to `up`")


def cmd_up(args: argparse.Namespace) -> int:
    """create the namespaces and links; run until Ctrl-C, then remove them

    Create one namespace per site and one emulated link per pair of sites, print how to run
    a program in each site, and serve until Ctrl-C or SIGTERM; then remove the namespaces,
    veths and iptables rules."""
    try:
        control = parse_address(args.control)
        spec = LinkSpec.from_distance(
            args.distance_km,
            args.bandwidth_mbit * 1e6,
            queue_bytes=args.queue_kib * 1024,
            per_flow_bps=args.per_flow_mbit * 1e6,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with TransparentWan(args.job, args.sites, spec, control=control) as wan:
            print(
                f"job {args.job}: {args.sites} site(s), every pair {args.distance_km:g} km "
                f"({spec.a_to_b.latency_s * 1e3:.2f} ms one way), "
                f"{args.bandwidth_mbit:g} Mbit/s each way"
                + (f", {args.per_flow_mbit:g} Mbit/s per flow" if args.per_flow_mbit else "")
            )
            for site in wan.sites:
                print(
                    f"  {site.site}  {site.address:<15} {site.namespace:<24} "
                    f"{shlex.join(site.exec_prefix)} PROGRAM"
                )
            address = wan.control_address
            print(f"control {address}  (isthmus wan show --control {address})")
            print("Ctrl-C to stop and remove everything.", flush=True)
            while not stop.wait(0.5):
                pass
    except (NetnsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"job {args.job}: removed", flush=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """remove a job's namespaces, veths and iptables rules (after a crash)

    Remove everything `netns up --job NAME` creates; stops processes still running inside
    its namespaces. Safe to run when nothing is left."""
    try:
        removed = teardown(args.job)
    except (NetnsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if any(removed.values()):
        print(
            f"job {args.job}: removed {len(removed['namespaces'])} namespace(s), "
            f"{len(removed['veths'])} veth(s), {len(removed['rules'])} iptables rule(s)"
        )
    else:
        print(f"job {args.job}: nothing to remove")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python3 -m isthmus.deploy.commands.netns up|down ...`, as `isthmus wan netns up|down ...`."""
    parser = argparse.ArgumentParser(prog="isthmus wan")
    register(parser.add_subparsers(dest="command", required=True), argparse.HelpFormatter)
    args = parser.parse_args(["netns", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
