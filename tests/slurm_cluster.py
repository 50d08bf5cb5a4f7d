"""A Slurm cluster of four nodes on this one machine, for the tests that submit the
templates of deploy/slurm/ with sbatch as a user does (tests/deploy/test_slurm.py).

The nodes are two sites of two nodes each, joined by one emulated link
(`isthmus.sim.transparent.TransparentWan` with ``nodes=[2, 2]``): every node is a
network namespace, a site's nodes share a LAN, and every TCP connection from one site
to the other crosses the link's relay, which resets any addressed outside the sites'
nodes. A lane advertised at the wrong node's address so reaches nothing, and the
link's counters show what the lanes sent.

Slurm runs as it does on real nodes: munged and slurmctld in the root namespace, and
on every node a slurmd in the node's network namespace and in a UTS namespace of its
own, so that it has its own host name (s0n0, s0n1, s1n0, s1n1), address, spool and log
folder, and the job steps it starts have them too. Slurm's traffic (slurmctld to each
slurmd, srun to the slurmd of every node of its job and back) runs on a management
network apart from the sites' links: a bridge in the root namespace and a veth from it
into every node. Each site is a partition (site0, site1), as each datacenter has a
Slurm of its own; munged's socket is a file, shared by every namespace.

Names resolve on every node as the job's programs need them (`ip netns exec`
bind-mounts /etc/netns/NS/hosts on /etc/hosts): a site's first node at its address on
the link (where the other site reaches its coordinator), the other nodes at their
LAN address. `unplug` takes a node off both its networks at once (its links down,
no reset sent) and `plug` puts it back. Everything is removed by `stop`, after a
failure too.
"""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from helpers import ROOT

from isthmus.deploy.chaos.ports import free_ports
from isthmus.sim import LinkSpec
from isthmus.sim.netns import LAN_IFNAME, LOCK_PATH, SiteNet
from isthmus.sim.transparent import TransparentWan

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
MANAGEMENT_POOL = "10.232.0.0/16"
"""The management network's /24 is taken from here (the sites' from sim/netns.py's pool)."""
MANAGEMENT_IFNAME = "mgmt0"
NODE_CPUS = 4
"""What each node claims, whatever the machine has: a job asks for one task a node."""

SLURM_CONF = """\
ClusterName=isthmus-test
SlurmctldHost=localhost({gateway})
SlurmctldPort={ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long plus 1 s before it starts again (120 s).
AuthInfo=socket={folder}/munge/socket,cred_expire=15
StateSaveLocation={folder}/state
SlurmctldPidFile={folder}/slurmctld.pid
SlurmctldLogFile={folder}/slurmctld.log
# One folder a node (%n: its NodeName), as on machines of their own.
SlurmdSpoolDir={folder}/%n/spool
SlurmdPidFile={folder}/%n/slurmd.pid
SlurmdLogFile={folder}/%n/slurmd.log
MailProg=/bin/true
# No cgroups: a container may not let slurmd create them. Jobs are tracked by
# process group, and nothing pins tasks to cores.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that stops answering is DOWN after 10 s (default 300) and its jobs requeued
# (JobRequeue=1, the default); it is back in service once its slurmd answers again.
SlurmdTimeout=10
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
{partitions}
"""


def missing_tools() -> list[str]:
    """The programs this cluster needs that are not on PATH."""
    return [
        tool
        for tool in (*TOOLS, "ip", "iptables", "nsenter", "unshare")
        if shutil.which(tool) is None
    ]


@dataclass(frozen=True, slots=True)
class Node:
    """One slurmd node."""

    name: str
    """Its host name and Slurm NodeName."""
    site: str
    namespace: str
    """Its network namespace."""
    address: str
    """Where the job's programs reach it: its name's address in every /etc/hosts."""
    management: str
    """Where Slurm reaches it (NodeAddr), on the management bridge."""

    @property
    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program in the node's network namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def as_node(self, command: str) -> list[str]:
        """The argv that runs the shell ``command`` as the node's slurmd and the job
        steps it starts run: in the node's network namespace, with its own host name
        and /etc/hosts. Not `ip netns exec`: it mounts a sysfs of its own, without the
        cgroup folders slurmd looks for at start even when it uses none."""
        hosts = Path("/etc/netns") / self.namespace / "hosts"
        return [
            "nsenter", f"--net=/run/netns/{self.namespace}", "--",
            "unshare", "--uts", "--mount", "--",
            "sh", "-c", f"hostname {self.name} && mount --bind {hosts} /etc/hosts && {command}",
        ]  # fmt: skip


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"`{shlex.join(argv)}` failed: {done.stderr.strip()}"
    return done.stdout


def _free_network(pool: str) -> ipaddress.IPv4Network:
    """A /24 of ``pool`` that no address or route of the root namespace touches."""
    used = [
        ipaddress.ip_interface(line.split()[3]).network
        for line in _run("ip", "-4", "-o", "addr", "show").splitlines()
    ]
    for line in _run("ip", "-4", "route", "show", "table", "all").splitlines():
        for token in line.split()[:2]:  # "DEST ..." or "TYPE DEST ..."
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(token, strict=False))
                break
    for net in ipaddress.IPv4Network(pool).subnets(new_prefix=24):
        if not any(net.overlaps(u) for u in used):
            return net
    raise AssertionError(f"no free /24 left in {pool}")


@dataclass
class SlurmCluster:
    """Four slurmd nodes in two sites (partitions site0 and site1) on one machine.

    Args:
        folder: where the cluster's configuration, state, spools and logs go.
        spec: the emulated link between the two sites.
    """

    folder: Path
    spec: LinkSpec
    job: str = field(default_factory=lambda: f"sl{os.getpid() % 100000}")
    wan: TransparentWan = field(init=False)
    nodes: list[Node] = field(init=False, default_factory=list)
    env: dict[str, str] = field(init=False, default_factory=dict)
    daemons: list[subprocess.Popen] = field(init=False, default_factory=list)
    gateway: str = field(init=False, default="")
    """The root namespace's address on the management bridge (slurmctld's)."""

    @property
    def bridge(self) -> str:
        return f"{self.job}mb"

    def start(self) -> SlurmCluster:
        """Create the namespaces and networks, start the daemons, wait for idle nodes."""
        self.wan = TransparentWan(self.job, 2, self.spec, nodes=[2, 2]).start()
        self.nodes = [node for site in self.wan.sites for node in _site_nodes(site)]
        self._management_network()
        for node in self.nodes:
            hosts = Path("/etc/netns") / node.namespace / "hosts"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(
                "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in self.nodes)
            )
            (self.folder / node.name / "spool").mkdir(parents=True)
        self._start_slurm()
        return self

    def _management_network(self) -> None:
        with open(LOCK_PATH, "w") as lock:  # sim/netns.py's: no two jobs take one /24
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = _free_network(MANAGEMENT_POOL)
            hosts = [str(h) for h in net.hosts()]
            self.gateway = hosts[0]
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for k, node in enumerate(self.nodes):
            veth = f"{self.job}m{k}"
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", MANAGEMENT_IFNAME,
                 "netns", node.namespace)  # fmt: skip
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            address = hosts[k + 1]
            in_node = node.exec_prefix
            _run(*in_node, "ip", "addr", "add", f"{address}/24", "dev", MANAGEMENT_IFNAME)
            _run(*in_node, "ip", "link", "set", MANAGEMENT_IFNAME, "up")
            self.nodes[k] = Node(node.name, node.site, node.namespace, node.address, address)

    def _start_slurm(self) -> None:
        munge = self.folder / "munge"
        for sub in ("munge", "state"):
            (self.folder / sub).mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        nodes = "\n".join(
            f"NodeName={n.name} NodeAddr={n.management} CPUs={NODE_CPUS} State=UNKNOWN"
            for n in self.nodes
        )
        partitions = "\n".join(
            f"PartitionName={site} Nodes={','.join(n.name for n in self.nodes if n.site == site)}"
            " MaxTime=INFINITE State=UP"
            for site in ("site0", "site1")
        )
        conf = self.folder / "slurm.conf"
        conf.write_text(
            SLURM_CONF.format(
                gateway=self.gateway,
                ctld_port=free_ports(1)[0],
                folder=self.folder,
                nodes=nodes,
                partitions=partitions,
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        # This cluster's own socket, in a 0700 folder: munged wants every user able to
        # reach it and refuses to start without --force (only root's jobs run here).
        self._daemon(
            "munged", ["munged", "-F", "--force", f"--socket={munge}/socket", f"--key-file={key}",
            f"--log-file={munge}/log", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed"],
        )  # fmt: skip
        self.wait_for(lambda: (munge / "socket").exists(), "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(conf)])
        for node in self.nodes:
            # The node's own host name and /etc/hosts, for slurmd and every step it starts.
            self._daemon(
                f"slurmd-{node.name}", node.as_node(f"exec slurmd -D -N {node.name} -f {conf}")
            )
        names = {n.name for n in self.nodes}
        self.wait_for(lambda: self.idle_nodes() == names, "idle nodes")

    def unplug(self, node: Node) -> None:
        """Take the node off both its networks at once (its LAN and the management
        bridge), as a pulled cable does: its links go down, nothing sends a reset."""
        self._set_links(node, "down")

    def plug(self, node: Node) -> None:
        """Put the node back on its networks."""
        self._set_links(node, "up")

    def end_jobs_on(self, node: Node) -> int:
        """SIGKILL every process of the node's jobs (all in its network namespace but
        its slurmd and what started it), as a node that crashed and came back holds none:
        a node back from a partition still runs the old steps of a job Slurm requeued
        under the same id, and slurmd's cleanup of those raced the requeued job's start
        there. Returns how many it ended."""
        keep = {"slurmd", "nsenter", "unshare", "sh"}
        ended = 0
        for pid in _run("ip", "netns", "pids", node.namespace).split():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                if name not in keep:
                    os.kill(int(pid), signal.SIGKILL)
                    ended += 1
            except (OSError, ValueError):
                continue  # gone already
        return ended

    def _set_links(self, node: Node, state: str) -> None:
        k = self.nodes.index(node)
        site = self.wan.site(node.site)
        if node.namespace != site.namespace:  # its port on the LAN bridge of the site's first node
            port = f"{LAN_IFNAME}p{[n.namespace for n in site.nodes].index(node.namespace) + 1}"
            _run("ip", "netns", "exec", site.namespace, "ip", "link", "set", port, state)
        _run("ip", "link", "set", f"{self.job}m{k}", state)

    def idle_nodes(self) -> set[str]:
        """The nodes slurmctld sees idle."""
        lines = self.run("sinfo", "-h", "-N", "-o", "%N %T").splitlines()
        return {name for name, state in (line.split() for line in lines) if state == "idle"}

    def _daemon(self, name: str, argv: list[str]) -> None:
        with (self.folder / f"{name}.out").open("w") as log:
            self.daemons.append(
                subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            )

    def wait_for(
        self, ready: Callable[[], bool], what: str, timeout: float = 30, jobs: Path | None = None
    ) -> None:
        """Poll ``ready`` until it holds; fail with the daemons' logs (and those of the
        jobs run in the folder ``jobs``) if a daemon died or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d.args for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                report = self.job_logs(jobs) if jobs is not None else ""
                raise AssertionError(f"no {what} ({dead or 'timeout'}):\n{self.logs()}{report}")
            time.sleep(0.2)

    def run(self, *argv: str) -> str:
        """A Slurm command's output ("" if it failed)."""
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return result.stdout if result.returncode == 0 else ""

    def logs(self) -> str:
        """The tails of the daemons' logs."""
        paths = sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log"))
        paths += sorted(self.folder.glob("*/slurmd.log"))
        return "\n".join(
            f"--- {p.relative_to(self.folder)} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in paths
        )

    def sbatch(self, script: str, *options: str, env: dict[str, str]) -> str:
        """Submit ``deploy/slurm/SCRIPT`` with the submitter's environment plus ``env``;
        returns the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(ROOT / "deploy" / "slurm" / script)],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) of a job slurmctld still knows (MinJobAge: 300 s)."""
        text = self.run("scontrol", "show", "job", "-o", job)
        found = dict(re.findall(r"(JobState|ExitCode)=(\S+)", text))
        return found.get("JobState", "UNKNOWN"), found.get("ExitCode", "")

    def wait(self, jobs: list[str], folder: Path, timeout: float) -> None:
        """Wait for every job to end; fail with their logs if one failed or hung."""
        deadline = time.monotonic() + timeout
        while True:
            states = {job: self.state(job) for job in jobs}
            if all(state in DONE_STATES for state, _ in states.values()):
                break
            if time.monotonic() > deadline:
                # A hang is read, not just timed: every process of the jobs prints its
                # threads' stacks on SIGUSR1 (isthmus and its ranks register it).
                self.run("scancel", "--full", "--signal=USR1", *jobs)
                time.sleep(3)
                self.run("scancel", *jobs)
                break
            time.sleep(0.5)
        assert all(s == ("COMPLETED", "0:0") for s in states.values()), (
            f"{states}\n{self.job_logs(folder)}"
        )

    @staticmethod
    def job_logs(folder: Path) -> str:
        """The tails of the outputs of the jobs run in ``folder`` and of their ranks' logs."""
        logs = sorted(folder.glob("*.out")) + sorted(folder.glob("runs/*/logs/*.log"))
        return "\n".join(
            f"--- {path.relative_to(folder)} ---\n{path.read_text(errors='replace')[-4000:]}"
            for path in logs
        )

    def stop(self) -> None:
        """Cancel what is left, let slurmd end its jobs, stop every daemon, and remove
        the namespaces, networks and hosts files (whatever of them exists)."""
        try:
            if self.daemons:
                self.run("scancel", "--user=root")
                deadline = time.monotonic() + 30
                while self.run("squeue", "-h") and time.monotonic() < deadline:
                    time.sleep(0.2)
            for daemon in reversed(self.daemons):
                daemon.terminate()
            for daemon in self.daemons:
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        finally:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
            for node in self.nodes:
                shutil.rmtree(Path("/etc/netns") / node.namespace, ignore_errors=True)
            if hasattr(self, "wan"):
                self.wan.close()  # the namespaces, their veths (and what still runs there)


def _site_nodes(site: SiteNet) -> list[Node]:
    """A site's nodes: the first at the site's address on the link, the others at
    their LAN address (management addresses come later)."""
    index = site.site.removeprefix("site")
    first = Node(f"s{index}n0", site.site, site.namespace, site.address, "")
    others = [
        Node(f"s{index}n{k}", site.site, node.namespace, node.address, "")
        for k, node in enumerate(site.nodes, start=1)
    ]
    return [first, *others]
