"""`isthmus site`: one site of a job, its coordinator and its ranks, as operators run it
(deploy/launch/site.py)."""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
import sys
from typing import TYPE_CHECKING

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import (
    add_config_arguments,
    add_job_flags,
    config_from_args,
    read_rank_secret,
    run_job,
)
from isthmus.deploy.commands.local import add_script_flag, use_script
from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.security.exposure import check_exposure

if TYPE_CHECKING:
    from isthmus.deploy.launch.site import NodePlace

__all__ = ["register"]

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def route_source(host: str) -> str:
    """This machine's address on its route to ``host``: what a peer that reaches
    ``host`` reaches this node at too (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"--advertise-host auto: no route to {host}: {exc}") from exc


def interface_of(address: str) -> str:
    """The name of the interface holding IPv4 ``address``; "" when none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return ""


def _advertise(args: argparse.Namespace) -> str:
    """The --advertise-host to apply: ``auto`` becomes this node's address toward the
    first node (or, on one node, toward the first peer coordinator)."""
    if args.advertise_host != "auto":
        return args.advertise_host or ""
    if args.master_addr:
        return route_source(args.master_addr)
    peers = [a for s, a in config_from_args(args).cluster.coordinators.items() if s != args.site]
    if not peers:
        raise ConfigError("--advertise-host auto needs --master-addr or a peer coordinator")
    return route_source(_host(peers[0]))


def _place(args: argparse.Namespace) -> NodePlace:
    from isthmus.deploy.launch.site import NodePlace

    secret = read_rank_secret(args.rank_secret_file) if args.rank_secret_file else None
    if args.listen and not args.listen.rpartition(":")[2].isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {args.listen!r}")
    gloo = ""
    if args.nodes > 1 and args.master_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
        # The ranks' gloo traffic on the interface that reaches the first node; left
        # alone, gloo takes the address its host name resolves to (127.0.1.1 on Debian).
        gloo = interface_of(route_source(args.master_addr))
    return NodePlace(
        nodes=args.nodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or "",
        master_port=args.master_port,
        listen=args.listen or "",
        rank_secret=secret,
        gloo_ifname=gloo,
    )


def cmd_site(args: argparse.Namespace) -> int:
    """run one site of a job (or one node of it): its coordinator and its ranks

    Run one site of a multi-site job on this machine: serve its coordinator at
    cluster.coordinators.SITE, start its ranks, wait for the peer sites (with a countdown),
    train, and exit once every site's final parameter digest is known. Every site needs
    cluster.coordinators for all sites; cluster.proxies routes a peer through an emulated
    link (isthmus wan up). A site on several nodes runs this once a node, as torchrun is
    run: --nodes, --node-rank, --master-addr and --rank-secret-file (docs/clusters.md)."""
    from isthmus.deploy.launch.site import SiteJob
    from isthmus.deploy.rank.checkpointing import resolve_resume

    advertised = _advertise(args)
    if advertised:  # before the config is checked: lanes on 0.0.0.0 need it
        args.overrides = [*args.overrides, f"cluster.advertise_host={advertised}"]
    config = config_from_args(args)
    use_script(args, config)
    if args.listen and ":" not in args.listen:  # a host: on the port peers dial
        named = config.cluster.coordinators.get(args.site, "")
        if not named.rpartition(":")[2].isdigit():
            raise ConfigError(
                f"--listen {args.listen} names no port, and cluster.coordinators has none "
                f"for {args.site}: give --listen HOST:PORT"
            )
        args.listen = f"{args.listen}:{named.rpartition(':')[2]}"
    place = _place(args)
    place.check(config, args.site)
    coordinator = place.listen or config.cluster.coordinators.get(args.site, "127.0.0.1:0")
    check_exposure(config.security, config.cluster, args.site, _host(coordinator), sys.stderr)
    if place.node_rank == 0:
        resolve_resume(config, [args.site], resume=args.resume)
    job = SiteJob(config, args.site, out=sys.stderr, progress=not args.quiet, place=place)
    if place.node_rank > 0:
        ran = job.run()
        print(f"{args.site} node {place.node_rank}: ranks {ran['ranks']} ended", flush=True)
        return 0
    return run_job(job, f"summary of {args.site}:")


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "site", cmd_site)
    add_config_arguments(parser, common_flags=True)
    parser.add_argument("--site", required=True, help="this site's name (site0, site1, ...)")
    add_script_flag(parser)
    add_job_flags(
        parser,
        resume_help="start from this site's newest complete checkpoint; a peer that would "
        "start from another step is refused at join",
    )
    node = parser.add_argument_group("a site on several nodes (one launcher a node)")
    add = node.add_argument
    add("--nodes", type=int, default=1, help="nodes the site spans")
    add(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index; node 0 serves the "
        "coordinator, node K starts site ranks K*L..K*L+L-1 (L = ranks / nodes)",
    )
    add(
        "--master-addr",
        metavar="HOST",
        help="the first node's address as the others reach it "
        "(the ranks' env:// rendezvous and the coordinator)",
    )
    add("--master-port", type=int, default=29500, help="the ranks' rendezvous port on node 0")
    add(
        "--listen",
        metavar="HOST[:PORT]",
        help="where the coordinator binds (default: "
        "cluster.coordinators.SITE), e.g. 0.0.0.0 where peers reach it under another name; without "
        "a port, the one cluster.coordinators.SITE gives",
    )
    add(
        "--advertise-host",
        metavar="HOST|auto",
        help="the address peers reach this node's lanes "
        "at (cluster.advertise_host); auto: this node's address on its route to "
        "--master-addr",
    )
    add(
        "--rank-secret-file",
        metavar="PATH",
        help="a file of >= 16 random bytes only its owner "
        "reads, the same on every node: each node derives its ranks' registration keys from it "
        "(needed with --nodes > 1)",
    )
