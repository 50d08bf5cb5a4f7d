"""Per-site network namespaces whose TCP reaches other sites only through the relay.

For transparent mode (`isthmus.sim.transparent`; docs/transparent.md, "How it works",
gives the namespaces, addresses and iptables rules). A site may span several nodes
(`create_sites(..., nodes=[2, 1])`): its namespace is the first node, and each further
node is a namespace `isthmus-<job>-<site>-n<k>` on a LAN /24 of the site's own (a bridge
`lan0` in the first node), which forwards the others' traffic through the site's veth,
so it takes the same redirect. Everything a job creates is found again by name
(namespaces and veths) and comment (rules), so `teardown(job)` needs no state and also
cleans up after a crash."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "DEFAULT_POOL",
    "NetnsError",
    "NodeNet",
    "SiteNet",
    "create_sites",
    "job_resources",
    "netns_exec",
    "redirect_tcp",
    "require_tools",
    "teardown",
]

DEFAULT_POOL = "10.231.0.0/16"
"""The /24s of sites are taken from here, skipping any a route or address already uses."""
SITE_IFNAME = "isthmus0"
"""The veth end inside every site's namespace."""
LOCK_PATH = "/run/isthmus-netns.lock"
"""Serializes /24 allocation between jobs created at the same time."""
LAN_IFNAME = "lan0"
"""A multi-node site's LAN interface in each of its nodes (the bridge in the first): the
one GLOO_SOCKET_IFNAME names."""
STOP_GRACE_S = 3.0
_JOB_RE = re.compile(r"[a-z0-9]{1,8}")  # veth names must fit IFNAMSIZ (15 characters)
_MAX_SITES = 100


class NetnsError(RuntimeError):
    """Setting up or tearing down namespaces failed; the message says which command and why."""


def netns_exec(namespace: str) -> list[str]:
    """The command prefix that runs a program in network namespace ``namespace``."""
    return ["ip", "netns", "exec", namespace]


@dataclass(frozen=True, slots=True)
class NodeNet:
    """A further node of a multi-node site: a namespace of its own on the site's LAN."""

    site: str
    namespace: str  # `isthmus-<job>-<site>-n<k>`
    address: str  # on the site's LAN (`lan0`)

    @property
    def exec_prefix(self) -> list[str]:
        return netns_exec(self.namespace)


@dataclass(frozen=True, slots=True)
class SiteNet:
    """One site's namespace and its addresses."""

    site: str  # "site0", "site1", ... (as `isthmus local` names them)
    namespace: str  # `isthmus-<job>-<site>`
    address: str  # inside its namespace (on `isthmus0`)
    gateway: str  # the root namespace's end of the veth; the site's relay listener binds here
    veth: str  # the name of the root namespace's end of the veth
    lan_address: str = ""
    """A multi-node site's first node on its LAN (`lan0`): where the other nodes reach
    it (MASTER_ADDR, the coordinator); empty for a site of one node."""
    nodes: tuple[NodeNet, ...] = ()  # the site's further nodes

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every address of the site that other sites reach it at (its nodes')."""
        return (self.address, *(n.address for n in self.nodes))

    @property
    def exec_prefix(self) -> list[str]:
        return netns_exec(self.namespace)


def require_tools() -> None:
    """Raise `NetnsError` unless this process is root and `ip` and `iptables` exist."""
    if os.geteuid() != 0:
        raise NetnsError("transparent mode needs root (network namespaces and iptables)")
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"missing {' and '.join(missing)} on PATH; on Debian/Ubuntu: "
            "apt-get install -y iproute2 iptables"
        )


def _check_job(job: str) -> None:
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
        raise ValueError(f"job must be 1-8 characters of [a-z0-9], got {job!r}")


def _run(*cmd: str, check: bool = True) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"`{shlex.join(cmd)}` failed: {e}") from e
    if check and done.returncode != 0:
        raise NetnsError(
            f"`{shlex.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def _comment(job: str) -> list[str]:
    return ["-m", "comment", "--comment", f"isthmus:{job}"]


def _namespace_prefix(job: str) -> str:
    return f"isthmus-{job}-"


def _veth(job: str, index: int) -> str:
    return f"is-{job}-{index}"


@contextlib.contextmanager
def _allocation_lock() -> Iterator[None]:
    with open(LOCK_PATH, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _free_subnets(pool: str, count: int) -> list[ipaddress.IPv4Network]:
    """`count` /24s of `pool` that no address or route of the root namespace touches."""
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in _run("ip", "-4", "-o", "addr", "show").splitlines():
        fields = line.split()
        used.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _run("ip", "-4", "route", "show", "table", "all").splitlines():
        for token in line.split()[:2]:  # "DEST ..." or "TYPE DEST ..." (local, unreachable)
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(token, strict=False))
                break
    free = [
        net
        for net in ipaddress.IPv4Network(pool).subnets(new_prefix=24)
        if not any(net.overlaps(u) for u in used)
    ]
    if len(free) < count:
        raise NetnsError(f"only {len(free)} free /24s left in {pool}, need {count}")
    return free[:count]


def job_resources(job: str) -> dict[str, list[str]]:
    """What exists of `job` now: {"namespaces", "veths" (root side), "rules" (as `-S`
    lines)}, each possibly empty."""
    _check_job(job)
    namespaces = [
        line.split()[0]
        for line in _run("ip", "netns", "list").splitlines()
        if line.split() and line.split()[0].startswith(_namespace_prefix(job))
    ]
    veth_re = re.compile(rf"is-{job}-\d+")
    veths = [
        name.split("@")[0]
        for line in _run("ip", "-o", "link", "show").splitlines()
        if veth_re.fullmatch((name := line.split(": ")[1]).split("@")[0])
    ]
    rules = []
    if shutil.which("iptables"):
        tag = f"isthmus:{job}"
        for table in ("nat", "filter"):
            rules += [
                f"-t {table} {line}"
                for line in _run("iptables", "-t", table, "-S").splitlines()
                if line.startswith("-A ") and tag in shlex.split(line)
            ]
    return {"namespaces": namespaces, "veths": veths, "rules": rules}


def _stop_processes(namespace: str) -> int:
    """SIGTERM (then SIGKILL) what still runs in `namespace`; returns how many there were."""
    pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            alive = _run("ip", "netns", "pids", namespace, check=False).split()
            if not alive:
                return len(pids)
            time.sleep(0.05)
        pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).split()]
    return len(pids)


def teardown(job: str) -> dict[str, list[str]]:
    """Remove every namespace, veth and iptables rule of `job` (idempotent); returns what
    was removed, as `job_resources` lists it. Processes still inside are stopped first: a
    namespace outlives its name while a process holds it."""
    require_tools()
    found = job_resources(job)
    for rule in found["rules"]:
        _, table, spec = rule.split(" ", 2)  # "-t TABLE -A CHAIN ..."
        _run("iptables", "-t", table, "-D", *shlex.split(spec)[1:], check=False)
    for namespace in found["namespaces"]:
        _stop_processes(namespace)
        _run("ip", "netns", "delete", namespace, check=False)
    for veth in found["veths"]:
        _run("ip", "link", "delete", veth, check=False)  # also removes its peer
    left = job_resources(job)
    if any(left.values()):
        raise NetnsError(f"teardown of job {job!r} left {left}")
    return found


def _disable_ipv6(interface: str, namespace: str | None = None) -> None:
    # Without IPv6 there is no link-local address for a program to bypass the rules with.
    path = f"/proc/sys/net/ipv6/conf/{interface}/disable_ipv6"
    prefix = netns_exec(namespace) if namespace else []
    _run(*prefix, "sh", "-c", f"[ ! -e {path} ] || echo 1 > {path}")


def create_sites(
    job: str, sites: int, *, pool: str = DEFAULT_POOL, nodes: list[int] | None = None
) -> list[SiteNet]:
    """Create one namespace and veth per site, isolated by filter rules; no TCP path yet
    (`redirect_tcp` next, `teardown` when done; a failure removes what was made). `job`
    (1-8 of [a-z0-9]) names everything; the /24s come from `pool`; a site of several
    `nodes` gets a LAN /24 and a namespace per further node."""
    _check_job(job)
    if isinstance(sites, bool) or not isinstance(sites, int) or not 1 <= sites <= _MAX_SITES:
        raise ValueError(f"sites must be an int in [1, {_MAX_SITES}], got {sites!r}")
    nodes = [1] * sites if nodes is None else list(nodes)
    if len(nodes) != sites or not all(type(n) is int and 1 <= n <= 200 for n in nodes):
        raise ValueError(f"nodes must list 1-200 nodes for each of {sites} site(s), got {nodes!r}")
    require_tools()
    if any(job_resources(job).values()):
        raise NetnsError(f"job {job!r} exists; remove it with `isthmus wan netns down --job {job}`")
    try:
        with _allocation_lock():
            lans = sum(n > 1 for n in nodes)
            subnets = _free_subnets(pool, sites + lans)
            site_nets, lan_iter = subnets[:sites], iter(subnets[sites:])
            site_lans = [next(lan_iter) if n > 1 else None for n in nodes]
            nets = [
                _create_site(job, i, net, subnets, site_lans[i], nodes[i])
                for i, net in enumerate(site_nets)
            ]
    except BaseException:
        with contextlib.suppress(NetnsError):
            teardown(job)
        raise
    return nets


def _create_site(
    job: str,
    index: int,
    net: ipaddress.IPv4Network,
    all_nets: list[ipaddress.IPv4Network],
    lan: ipaddress.IPv4Network | None,
    node_count: int,
) -> SiteNet:
    hosts = list(net.hosts())
    name, namespace = f"site{index}", f"{_namespace_prefix(job)}site{index}"
    lan_hosts = list(lan.hosts()) if lan else []
    site = SiteNet(
        site=name,
        namespace=namespace,
        address=str(hosts[1]),
        gateway=str(hosts[0]),
        veth=_veth(job, index),
        lan_address=str(lan_hosts[0]) if lan else "",
        nodes=tuple(
            NodeNet(name, f"{namespace}-n{k}", str(lan_hosts[k])) for k in range(1, node_count)
        ),
    )
    ns, peer = site.namespace, f"ip-{job}-{index}"
    in_ns = netns_exec(ns)
    _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", site.veth, "type", "veth", "peer", "name", peer)
    # Filter rules before any address exists: nothing crosses the root namespace
    # except what the relay carries. -I puts each first, so insert in reverse order.
    tag = _comment(job)
    for rule in (
        ["FORWARD", "-o", site.veth, "-j", "DROP"],
        ["FORWARD", "-i", site.veth, "-j", "DROP"],
        ["INPUT", "-i", site.veth, "-j", "DROP"],
        ["INPUT", "-i", site.veth, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"]
        + ["-j", "ACCEPT"],
    ):
        _run("iptables", "-I", *rule[:1], "1", *rule[1:], *tag)
    _disable_ipv6(site.veth)
    _run("ip", "link", "set", peer, "netns", ns)
    _run(*in_ns, "ip", "link", "set", peer, "name", SITE_IFNAME)
    _disable_ipv6(SITE_IFNAME, ns)
    _run("ip", "addr", "add", f"{site.gateway}/24", "dev", site.veth)
    _run("ip", "link", "set", site.veth, "up")
    _run(*in_ns, "ip", "addr", "add", f"{site.address}/24", "dev", SITE_IFNAME)
    _run(*in_ns, "ip", "link", "set", SITE_IFNAME, "up")
    _run(*in_ns, "ip", "link", "set", "lo", "up")
    for other in all_nets:
        if other not in (net, lan):
            _run(*in_ns, "ip", "route", "add", str(other), "via", site.gateway)
    if lan is not None:
        _create_lan(site, lan, all_nets)
    return site


def _create_lan(
    site: SiteNet, lan: ipaddress.IPv4Network, all_nets: list[ipaddress.IPv4Network]
) -> None:
    """The site's LAN: a bridge `lan0` in the first node, a veth from it to each further node."""
    first = site.exec_prefix
    # The relay in the root namespace dials the further nodes through the site's veth.
    _run("ip", "route", "add", str(lan), "via", site.address, "dev", site.veth)
    _run(*first, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")  # this netns only
    _run(*first, "ip", "link", "add", LAN_IFNAME, "type", "bridge")
    _disable_ipv6(LAN_IFNAME, site.namespace)
    _run(*first, "ip", "addr", "add", f"{site.lan_address}/24", "dev", LAN_IFNAME)
    _run(*first, "ip", "link", "set", LAN_IFNAME, "up")
    for k, node in enumerate(site.nodes, start=1):
        in_node = node.exec_prefix
        port = f"{LAN_IFNAME}p{k}"  # the bridge's port to node k
        _run("ip", "netns", "add", node.namespace)
        # Both ends are made inside the namespaces: nothing of the LAN is in the root's.
        _run(*first, "ip", "link", "add", port, "type", "veth", "peer", "name", LAN_IFNAME,
             "netns", node.namespace)  # fmt: skip
        _disable_ipv6(port, site.namespace)
        _disable_ipv6(LAN_IFNAME, node.namespace)
        _run(*first, "ip", "link", "set", port, "master", LAN_IFNAME, "up")
        _run(*in_node, "ip", "addr", "add", f"{node.address}/24", "dev", LAN_IFNAME)
        _run(*in_node, "ip", "link", "set", LAN_IFNAME, "up")
        _run(*in_node, "ip", "link", "set", "lo", "up")
        for other in all_nets:  # every other /24 of the job, the site's own included
            if other != lan:
                _run(*in_node, "ip", "route", "add", str(other), "via", site.lan_address)


def redirect_tcp(job: str, site: SiteNet, port: int) -> None:
    """Send every TCP connection leaving `site` to the relay listener at `site.gateway:port`."""
    _check_job(job)
    tag = _comment(job)
    _run(
        "iptables", "-I", "INPUT", "1", "-i", site.veth, "-p", "tcp", "-d", site.gateway,
        "--dport", str(port), "-j", "ACCEPT", *tag,
    )  # fmt: skip
    _run(
        "iptables", "-t", "nat", "-A", "PREROUTING", "-i", site.veth, "-p", "tcp",
        "-j", "REDIRECT", "--to-ports", str(port), *tag,
    )  # fmt: skip
