"""`isthmus probe`: measure the links of a job before it runs (RTT, loss, 1-flow and
N-flow throughput, the per-flow cap they imply) and audit the host's TCP settings;
`isthmus probe serve` is the other end (deploy/launch/probe.py, probe_server.py, probe_audit.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import add_set_argument
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.launch.probe import measure_link, parse_address, probe_pair
from isthmus.deploy.launch.probe_audit import audit
from isthmus.deploy.launch.probe_server import ProbeServer

DEFAULT_PORT = 7171
FLOWS = 8
"""Flows of the N-flow phase: a 25 Gbit/s link under a 5 Gbit/s cap a flow (AWS's) needs
5, and 8 stays within sync.connections' 16 while a 2-core host still feeds them."""


def _address(text: str, what: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _progress(line: str) -> None:
    print(f"probe: {line}", file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, token: bytes) -> int:
    if not args.listen:
        raise ConfigError("`isthmus probe serve` needs --listen HOST:PORT")
    server = ProbeServer(
        _address(args.listen, "--listen"),
        token,
        audit=lambda link: audit([link], args.sysctl_root),
    )
    try:
        host, port = server.server_address[:2]
        print(f"probe server listening on {host!s}:{port}", flush=True)
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _site_addresses(args: argparse.Namespace) -> dict[str, str]:
    """Each site's probe server: its coordinator's host (cluster.coordinators) at
    --port, or what --site NAME=HOST:PORT says."""
    given = {}
    for text in args.site:
        name, _, where = text.partition("=")
        _address(where, f"--site {text}")
        given[name] = where
    if args.config is None:
        return given
    config = load_config(args.config, args.overrides)
    unknown = sorted(set(given) - set(config.site_names))
    if unknown:
        raise ConfigError(f"--site names unknown sites {unknown}; sites are {config.site_names}")
    out = {}
    for site in config.site_names:
        coordinator = config.cluster.coordinators.get(site)
        if site not in given and coordinator is None:
            raise ConfigError(
                f"no address for {site}: set cluster.coordinators.{site} in the job file "
                f"(its probe server at that host, --port) or pass --site {site}=HOST:PORT"
            )
        host = _address(coordinator, f"cluster.coordinators.{site}")[0] if coordinator else ""
        out[site] = given.get(site, f"{host}:{args.port}")
    return out


def _measure(args: argparse.Namespace, token: bytes) -> list[dict[str, Any]]:
    kwargs = {"flows": args.flows, "seconds": args.seconds, "token": token}
    if args.config is None and not args.site:
        if not args.target:
            raise ConfigError("give HOST:PORT, --config JOB.toml or --site NAME=HOST:PORT pairs")
        _address(args.target, "target")
        link = measure_link(args.target, progress=_progress, **kwargs)
        return [
            {"from": "here", "to": args.target, **link, "audit": audit([link], args.sysctl_root)}
        ]
    sites = _site_addresses(args)
    if len(sites) < 2:
        raise ConfigError(f"need two sites or more to probe, got {sorted(sites)}")
    links = []
    for a, b in itertools.combinations(sites, 2):
        _progress(f"{a} ({sites[a]}) -> {b} ({sites[b]}), about {3 * args.seconds:g} s")
        links.append({"from": a, "to": b, **probe_pair(sites[a], sites[b], **kwargs)})
    return links


def _table(links: list[dict[str, Any]]) -> None:
    flows = links[0]["flows"]
    print(
        f"{'link':<24} {'RTT ms':>8} {'1 flow':>8} {f'{flows} flows':>9} {'cap/flow':>9} "
        f"{'loss':>7} {'MTU':>6}  congestion   (Gbit/s)"
    )
    for link in links:
        cap = link["per_flow_cap_gbit"]
        print(
            f"{link['from'] + ' -> ' + link['to']:<24} {link['rtt_ms']:8.2f} "
            f"{link['gbit_1flow']:8.3f} {link['gbit_nflows']:9.3f} "
            f"{'-' if cap is None else f'{cap:.3f}':>9} {link['loss']:7.2%} "
            f"{link['mtu'] or '-':>6}  {link['congestion'] or '-'}"
        )
    for link in links:
        if link.get("audit"):
            who = "this host" if link["from"] == "here" else f"the host of {link['from']}"
            print(f"advice for {who} (it measured {link['to']}):")
            for finding in link["audit"]:
                print(f"  - {finding['advice']}")


def cmd_probe(args: argparse.Namespace) -> int:
    """measure the links between sites before a job

    `isthmus probe serve --listen HOST:PORT` at each site, then `isthmus probe HOST:PORT`
    (here to there) or `isthmus probe --config job.toml` (every pair of the job's sites,
    each measured from its first site's server) prints each link's RTT, throughput with 1
    flow and with --flows, the per-flow cap that implies, loss, MTU and congestion
    control, and one line of advice per finding of the measuring host's TCP settings.
    --json FILE keeps them, for `wan.probe = FILE` in a job and `isthmus plan --probe`."""
    token = Path(args.token_file).read_bytes().strip() if args.token_file else b""
    if args.target == "serve":
        return _serve(args, token)
    try:
        links = _measure(args, token)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _table(links)
    if args.json:
        result = {"flows": args.flows, "seconds": args.seconds, "links": links}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "probe", cmd_probe)
    add = parser.add_argument
    add("target", nargs="?", metavar="HOST:PORT|serve", help="a probe server, or `serve`")
    add("--listen", metavar="HOST:PORT", help="serve: where to listen (port 0: any)")
    add("--config", metavar="TOML", help="probe every pair of this job's sites")
    add_set_argument(parser)
    add("--site", metavar="NAME=HOST:PORT", action="append", default=[], help="a site's server")
    add("--port", type=int, default=DEFAULT_PORT, help="probe port at each coordinator's host")
    add("--flows", type=int, default=FLOWS, help="flows of the many-flow phase")
    add("--seconds", type=float, default=3.0, help="length of each phase")
    add("--json", metavar="FILE", help="write the links as JSON (wan.probe, plan --probe)")
    add("--token-file", help="a job token both ends share (required by a server given one)")
    add("--sysctl-root", default="/proc/sys", help="audit the settings under this folder")
