"""`isthmus wan`: run emulated links standalone, and show or change them while they run.

`up` serves a topology file's links (`isthmus.sim.topology`) with a control endpoint
(`isthmus.sim.control`) that `show` and `set` talk to, as does `netns up` (transparent
mode, `isthmus.deploy.commands.netns`) for its links "site0-site1", ... Bad input prints
one `error:` line and changes nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from isthmus.deploy.commands import add_command, add_group
from isthmus.sim import RelayServer, Topology, control_request, load_topology
from isthmus.sim.control import DEFAULT_ADDRESS, parse_address
from isthmus.sim.spec import MIN_QUEUE_S, DirectionSpec
from isthmus.sim.topology import spec_to_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

DEFAULT_CONTROL = DEFAULT_ADDRESS
CONTROL_HELP = "control endpoint of `isthmus wan up`, HOST:PORT on loopback"
EXIT_USAGE = 2  # as deploy/cli.py
EXIT_INTERRUPTED = 130


def _error(message: str) -> ValueError:
    """The error to raise for bad input: a `ConfigError`, which `isthmus` prints as one
    line. deploy/config/job.py imports torch, which takes seconds, so when it is not loaded
    (`python -m isthmus.deploy.commands.wan`, whose `main` prints any ValueError the same
    way) a plain ValueError does."""
    config = sys.modules.get("isthmus.deploy.config.job")
    return config.ConfigError(message) if config is not None else ValueError(message)


def register(
    sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter] | None = None
) -> None:
    """emulate WAN links standalone; show or change them live

    Emulate the links of a topology file (sites, and latency, bandwidth, queue and
    impairments per pair and direction) for any TCP program, and show or change them while
    they run. See docs/wan.md."""
    if formatter is None:
        from isthmus.deploy.commands.arguments import HelpFormatter

        formatter = HelpFormatter
    wsub = add_group(sub, formatter, "wan", register, "wan_command")
    from isthmus.deploy.commands import netns as netns_cmd

    netns_cmd.register(wsub, formatter)  # `netns up` serves the control endpoint too
    _add_up(wsub, formatter)
    _add_show(wsub, formatter)
    _add_set(wsub, formatter)


def _add_up(wsub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    up = add_command(wsub, formatter, "up", cmd_up)
    add = up.add_argument
    add("topology", metavar="TOPOLOGY", help="topology file (TOML, see docs/wan.md)")
    add("--control", default=DEFAULT_CONTROL, metavar="HOST:PORT", help=CONTROL_HELP + " (0: any)")
    add(
        "--forward",
        action="append",
        default=[],
        metavar="SITE_A:SITE_B=HOST:PORT",
        help="also "
        "listen for plain TCP from SITE_A and forward it to HOST:PORT (a loopback server standing "
        "for SITE_B) across the link (repeatable)",
    )
    add(
        "--proxy-port",
        type=int,
        default=0,
        metavar="PORT",
        help="first port of the proxies, one "
        "per link direction in the file's order (so a job config can name them); 0 = any free "
        "ports",
    )
    add(
        "--processes",
        action="store_true",
        help="pump each link direction in a process of its "
        "own, not a thread of this one (links past ~15 Gbit/s loaded both ways, or many fast "
        "links: one process moves ~30-50 Gbit/s summed)",
    )


def _add_show(wsub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    show = add_command(wsub, formatter, "show", cmd_show)
    add = show.add_argument
    add("link", nargs="?", metavar="LINK", help="one link (a-b)")
    add("--control", default=DEFAULT_CONTROL, metavar="HOST:PORT", help=CONTROL_HELP)
    add("--json", action="store_true", help="print the endpoint's JSON")


def _add_set(wsub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    change = add_command(wsub, formatter, "set", cmd_set)
    add = change.add_argument
    add("link", metavar="LINK", help="the link to change (a-b)")
    add("changes", nargs="+", metavar="KEY=VALUE", help="what to change")
    add("--control", default=DEFAULT_CONTROL, metavar="HOST:PORT", help=CONTROL_HELP)


def cmd_up(args: argparse.Namespace) -> int:
    """run the links of a topology file in the foreground

    Run one emulated link per pair of sites of TOPOLOGY, until Ctrl-C or SIGTERM. Prints,
    for each direction, the HTTP CONNECT proxy URL to route through (gRPC: channel option
    grpc.http_proxy, and env no_grpc_proxy=none.invalid), each --forward's address, and the
    control address for `isthmus wan show/set`."""
    topology = _load(args.topology)
    forwards = [_parse_forward(text, topology) for text in args.forward]
    host, port = _address(args.control, "--control")
    relay = RelayServer(processes=args.processes).start()
    try:
        print(f"isthmus wan: {len(topology.sites)} sites from {args.topology}", flush=True)
        next_port = args.proxy_port
        for tl in topology.links:
            link = relay.add_link(tl.name, tl.spec)
            print(f"link {tl.name}")
            tables = spec_to_table(tl.spec)
            for initiator, src, dst, direction in (
                ("a", tl.a, tl.b, "a_to_b"),
                ("b", tl.b, tl.a, "b_to_a"),
            ):
                try:
                    h, p = link.add_proxy(initiator=initiator, port=next_port)
                except OSError as exc:
                    raise _error(f"--proxy-port: port {next_port}: {exc.strerror}") from None
                next_port = next_port + 1 if next_port else 0
                print(f"  {src} -> {dst}  {_summary(tables[direction])}")
                print(f"    proxy   http://{h}:{p}")
                for a, b, target_host, target_port in forwards:
                    if (a, b) == (src, dst):
                        h, p = link.add_forward(target_host, target_port, initiator=initiator)
                        print(f"    forward {h}:{p} -> {target_host}:{target_port}")
        try:
            control = relay.serve_control(host, port)
        except OSError as exc:
            raise _error(f"--control {args.control}: {exc}") from None
        print(f"control {control.address}  (isthmus wan show --control {control.address})")
        print("ready; Ctrl-C or SIGTERM stops every link", flush=True)
        while True:
            time.sleep(3600)
    finally:
        relay.close()


def cmd_show(args: argparse.Namespace) -> int:
    """print the links' specs and counters

    Print each link's spec per direction, what its impairments did so far (lost segments,
    stalls, corrupted bytes, ...) and its listeners."""
    path = "/links" if args.link is None else f"/links/{args.link}"
    answer = _request(args.control, "GET", path)
    links = answer if args.link is None else {args.link: answer}
    if args.json:
        print(json.dumps(links, indent=2))
        return 0
    for name, link in links.items():
        _print_link(name, link)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    """change a live link

    Change a running link at once, for bytes sent afterwards. Keys are those of a link in a
    topology file: distance_km, latency_ms, bandwidth_mbit, per_flow_mbit, queue_kib, seed,
    impairments (a TOML list, e.g. 'impairments=[{kind="loss", rate=0.001}]'); prefix
    a_to_b. or b_to_a. to change one direction only. Nothing changes if any key or value is
    wrong."""
    changes: dict[str, Any] = {}
    for text in args.changes:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise _error(f"expected KEY=VALUE, got {text!r}")
        direction, dot, name = key.rpartition(".")
        target = changes.setdefault(direction, {}) if dot else changes
        if not isinstance(target, dict):
            raise _error(f"{direction!r} is set both as a value and as a direction")
        target[name] = _value(raw)
    _print_link(args.link, _request(args.control, "POST", f"/links/{args.link}", changes))
    return 0


def _load(path: str) -> Topology:
    try:
        return load_topology(path)
    except ValueError as exc:
        raise _error(str(exc)) from None


def _parse_forward(text: str, topology: Topology) -> tuple[str, str, str, int]:
    pair, sep, address = text.partition("=")
    a, colon, b = pair.partition(":")
    if not sep or not colon:
        raise _error(f"--forward expects SITE_A:SITE_B=HOST:PORT, got {text!r}")
    for site in (a, b):
        if site not in topology.sites:
            raise _error(f"--forward {text!r}: {site!r} is not a site of the topology")
    if a == b:
        raise _error(f"--forward {text!r}: name two different sites")
    host, port = _address(address, "--forward")
    if port == 0:
        raise _error(f"--forward {text!r}: name the target's port")
    return a, b, host, port


def _address(text: str, flag: str) -> tuple[str, int]:
    try:
        return parse_address(text, flag)
    except ValueError as exc:
        raise _error(str(exc)) from None


def _value(raw: str) -> Any:
    """A TOML value (number, list, table, boolean, quoted string), else the bare text."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def _request(address: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    _address(address, "--control")
    try:
        return control_request(address, method, path, body)
    except ValueError as exc:
        raise _error(str(exc)) from None
    except OSError as exc:
        raise _error(f"no `isthmus wan up` control endpoint answers at {address}: {exc}") from None


def _summary(table: dict[str, Any]) -> str:
    bandwidth = table["bandwidth_mbit"]
    queue = table["queue_kib"]
    kept = (
        DirectionSpec(  # the rule the link applies (at least MIN_QUEUE_S of the rate)
            latency_s=0.0, bandwidth_bps=bandwidth * 1e6, queue_bytes=round(queue * 1024)
        ).queue_limit_bytes
        / 1024
    )
    parts = [
        f"{table['latency_ms']:.3g} ms",
        f"{bandwidth:g} Mbit/s" if bandwidth else "unlimited",
        f"queue {queue:g} KiB"
        if kept <= queue
        else f"queue {kept:.0f} KiB ({MIN_QUEUE_S * 1e3:g} ms of the rate; {queue:g} asked)",
    ]
    if table.get("per_flow_mbit"):
        parts.insert(2, f"{table['per_flow_mbit']:g} Mbit/s per flow")
    for imp in table["impairments"]:
        params = ", ".join(f"{k}={v}" for k, v in imp.items() if k != "kind" and v is not None)
        parts.append(f"{imp['kind']}({params})")
    return ", ".join(parts)


def _print_link(name: str, link: dict[str, Any]) -> None:
    print(f"link {name}")
    a, _, b = name.partition("-")
    for direction, src, dst in (("a_to_b", a, b), ("b_to_a", b, a)):
        print(f"  {src} -> {dst}  {_summary(link['spec'][direction])}")
        counters = ", ".join(f"{k}={v:g}" for k, v in link["stats"][direction].items())
        print(f"    {counters}")
    for listener in link["listeners"]:
        side = a if listener["initiator"] == "a" else b
        target = f" -> {listener['target']}" if "target" in listener else ""
        print(f"  {listener['kind']} for {side}: {listener['address']}{target}")


def main(argv: list[str] | None = None) -> int:
    """`python -m isthmus.deploy.commands.wan ARGS` = `isthmus wan ARGS` without importing
    torch (for scripts and tests); errors and Ctrl-C end it as `isthmus` does."""
    argv = sys.argv[1:] if argv is None else argv
    formatter = None if {"-h", "--help"} & set(argv) else argparse.HelpFormatter
    parser = argparse.ArgumentParser(prog="isthmus")
    register(parser.add_subparsers(dest="command", required=True), formatter)
    args = parser.parse_args(["wan", *argv])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return args.func(args)
    except ValueError as exc:  # ConfigError, and nothing else reaches here as ValueError
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
