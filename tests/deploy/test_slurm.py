"""Slurm for real: the templates of deploy/slurm/ submitted with sbatch to a one-node
cluster that the test runs itself (munged, slurmctld, slurmd from Debian's slurm-wlm
and munge, which `scripts/install.sh --dev` installs when root), two sites as two jobs
over an emulated link, trained to identical replicas.

The node has no GPUs, so each job is submitted as the templates' headers say for a CPU
node: `--gpus-per-node=0` and the CPU settings on the sbatch command line, which
override the scripts' #SBATCH lines (GPU counts, 64 CPUs per task).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ROOT

from isthmus.deploy.chaos.ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
NODE = "localhost"  # resolvable anywhere: the multi-node template's MASTER_ADDR
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
JOB_TIMEOUT_S = 300  # beyond sync.timeout_s: a site that gives up says why first


def require_slurm() -> None:
    """As root (CI), Slurm must be there: install.sh put it there, and a missing tool
    is a failure. Anyone else cannot run its daemons: skip, saying why."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test runs slurmctld and slurmd as root (CI does); not root here")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    assert not missing, (
        f"{missing} missing: `bash scripts/install.sh --dev` as root apt-installs slurm-wlm and munge"
    )


SLURM_CONF = """\
ClusterName=isthmus-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
MailProg=/bin/true
# No cgroups: a container (gVisor's included) may not let slurmd create them. Jobs are
# tracked by process group, and nothing pins tasks to cores.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# The node claims 8 CPUs whatever the machine has, so that two jobs of two tasks each
# (the two sites) run at once: a site waits for its peer.
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    """A one-node Slurm cluster in ``folder``, its daemons children of the test."""

    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> Cluster:
        munge = self.folder / "munge"
        for sub in ("munge", "state", "spool"):
            (self.folder / sub).mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        ctld_port, slurmd_port = free_ports(2)
        conf = self.folder / "slurm.conf"
        conf.write_text(
            SLURM_CONF.format(
                node=NODE, ctld_port=ctld_port, slurmd_port=slurmd_port, folder=self.folder
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        # This cluster's own socket, in a 0700 folder: munged wants every user able to
        # reach it and refuses to start without --force (only root's jobs run here).
        self._daemon(
            "munged", "-F", "--force", f"--socket={munge}/socket", f"--key-file={key}",
            f"--log-file={munge}/log", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed",
        )  # fmt: skip
        self._wait_for(lambda: (munge / "socket").exists(), "munged's socket")
        self._daemon("slurmctld", "-D", "-f", str(conf))
        self._daemon("slurmd", "-D", "-N", NODE, "-f", str(conf))
        self._wait_for(lambda: self.run("sinfo", "-h", "-o", "%T").strip() == "idle", "idle node")
        return self

    def _daemon(self, *argv: str) -> None:
        with (self.folder / f"{argv[0]}.out").open("w") as log:
            self.daemons.append(
                subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            )

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"no {what} ({dead or 'timeout'}):\n{self.logs()}")
            time.sleep(0.2)

    def run(self, *argv: str) -> str:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return result.stdout if result.returncode == 0 else ""

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log"))
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

    def wait(self, jobs: list[str], folder: Path) -> None:
        """Wait for every job to end; fail with their logs if one failed or hung."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
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
        logs = sorted(folder.glob("*.out")) + sorted(folder.glob("runs/*/logs/*.log"))
        report = "\n".join(
            f"--- {path.relative_to(folder)} ---\n{path.read_text(errors='replace')[-4000:]}"
            for path in logs
        )
        assert all(s == ("COMPLETED", "0:0") for s in states.values()), f"{states}\n{report}"

    def stop(self) -> None:
        """Cancel what is left, let slurmd end its jobs, then stop every daemon."""
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    require_slurm()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@dataclass
class Link:
    """`isthmus wan up` for site0-site1: proxy URLs per direction, and its counters."""

    process: subprocess.Popen
    proxies: dict[str, str]
    control: str

    def delivered(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://{self.control}/links", timeout=10) as answer:
            stats = json.load(answer)["site0-site1"]["stats"]
        return {d: stats[d]["bytes_delivered"] for d in ("a_to_b", "b_to_a")}


@pytest.fixture
def link(tmp_path) -> Iterator[Link]:
    topology = tmp_path / "link.toml"
    topology.write_text(
        'sites = ["site0", "site1"]\nseed = 1\n'
        '[links."site0-site1"]\ndistance_km = 100\nbandwidth_mbit = 1000\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "isthmus.deploy.commands.wan", "up", str(topology), "--control",
         "127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        text = "".join(lines)
        # "  site0 -> site1 ...\n    proxy   http://..." : site0 reaches site1 through it.
        routes = re.findall(r"(site\d) -> (site\d).*\n\s+proxy\s+(\S+)", text)
        control = re.search(r"^control (\S+)", text, re.M)
        assert len(routes) == 2 and control, text
        yield Link(process, {dst: url for _src, dst, url in routes}, control.group(1))
    finally:
        process.terminate()
        process.wait(10)


def write_job(tmp_path: Path, link: Link, ports: list[int], *extra: str) -> Path:
    coordinators = ", ".join(f'site{i} = "127.0.0.1:{p}"' for i, p in enumerate(ports))
    proxies = ", ".join(f'{site} = "{url}"' for site, url in link.proxies.items())
    path = tmp_path / "job.toml"
    path.write_text(
        "\n".join(
            [
                "[job]",
                "steps = 3",
                "[model]",
                'preset = "tiny"',
                "[run]",
                'log_level = "info"',  # the ranks' timeline, should a job fail
                "eval_batches = 1",  # no test here reads the held-out loss
                # Six processes importing torch at once on a loaded 2-core machine took
                # 110 s to reach their coordinators (the default joining deadline is 120).
                "[sync]",
                "timeout_s = 240",
                *extra,
                "[cluster]",
                f"coordinators = {{ {coordinators} }}",
                f"proxies = {{ {proxies} }}",
            ]
        )
        + "\n"
    )
    return path


def job_env() -> dict[str, str]:
    """What the submitter's shell has: this interpreter's `isthmus` and `python3` first
    on PATH (sbatch --export=ALL hands the environment to the job)."""
    bin_dir = str(Path(sys.executable).parent)
    # gRPC skips a proxy for hosts in no_proxy (often localhost): name none, as
    # `isthmus site` does for its ranks, so the lanes really cross the emulated link.
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "no_grpc_proxy": "none.invalid"}


def assert_identical_replicas(tmp_path: Path, link: Link, ranks: int) -> None:
    """Every rank of both sites (their results in the templates' run folders,
    runs/JOB_ID) ends with one parameter digest, and their lanes' bytes crossed the link."""
    results = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/sites/*/rank*.json")]
    assert sorted((r["site"], r["rank"]) for r in results) == [
        (site, rank) for site in ("site0", "site1") for rank in range(ranks)
    ], results
    assert len({r["digest"] for r in results}) == 1, results
    # a_to_b is what site0 sent site1: the relay counts every byte it forwarded, so at
    # least what site0's lanes sent (each rank's bytes_sent is its site's total), and
    # site1's the other way. Lanes that bypassed the emulated link fail this.
    sent = {r["site"]: r["bytes_sent"] for r in results if r["rank"] == 0}
    delivered = link.delivered()
    assert sent["site0"] > 0 and sent["site1"] > 0, sent
    assert delivered["a_to_b"] >= sent["site0"] and delivered["b_to_a"] >= sent["site1"], (
        delivered,
        sent,
    )


def test_two_sites_as_two_slurm_jobs_of_site_sbatch(cluster, link, tmp_path):
    job = write_job(tmp_path, link, free_ports(2))
    jobs = []
    for site in ("site0", "site1"):
        out = tmp_path / f"{site}.out"
        jobs.append(
            cluster.sbatch(
                "site.sbatch",
                "--gpus-per-node=0",
                "--cpus-per-task=1",
                f"--chdir={tmp_path}",
                f"--output={out}",
                f"--export=ALL,ISTHMUS_SITE={site},ISTHMUS_JOB={job},ISTHMUS_DEVICE=cpu,"
                "ISTHMUS_RANKS_PER_SITE=1",
                env=job_env(),
            )
        )
    cluster.wait(jobs, tmp_path)
    for site in ("site0", "site1"):  # `isthmus site` compared the final digests itself
        assert "replicas            identical" in (tmp_path / f"{site}.out").read_text()
    assert_identical_replicas(tmp_path, link, ranks=1)


def test_two_sites_as_two_slurm_jobs_of_site_multinode_sbatch(cluster, link, tmp_path, job_dir):
    """The multi-node template on one node: its coordinator listens beyond loopback,
    so the job has TLS and the token on; two srun tasks per site meet in torch's
    env:// rendezvous at MASTER_ADDR, the node's name."""
    coordinator_ports, master_ports = free_ports(2), free_ports(2)
    settings = [
        # The job's tasks set the site's rank count (2), not the file: the template
        # hands its coordinator and its ranks one resolved config.
        "[topology]", "ranks_per_site = 1",
        "[security]", "require_tls = true", "require_token = true", f'certs_dir = "{job_dir}"',
    ]  # fmt: skip
    job = write_job(tmp_path, link, coordinator_ports, *settings)
    # Where each site's node agent makes its socket's folder (the template's default is a
    # fresh name under /tmp; a socket's path must stay under 108 bytes).
    agent_dirs = {s: Path(f"/tmp/isthmus-test-agent-{os.getpid()}-{s}") for s in ("site0", "site1")}
    jobs = []
    for i, site in enumerate(("site0", "site1")):
        out = tmp_path / f"{site}.out"
        jobs.append(
            cluster.sbatch(
                "site-multinode.sbatch",
                "--nodes=1",
                "--ntasks-per-node=2",
                "--gpus-per-node=0",
                "--cpus-per-task=1",
                f"--chdir={tmp_path}",
                f"--output={out}",
                f"--export=ALL,ISTHMUS_SITE={site},ISTHMUS_JOB={job},"
                f"ISTHMUS_COORDINATOR_PORT={coordinator_ports[i]},"
                f"ISTHMUS_MASTER_PORT={master_ports[i]},ISTHMUS_AGENT_DIR={agent_dirs[site]}",
                env=job_env(),
            )
        )
    cluster.wait(jobs, tmp_path)
    assert_identical_replicas(tmp_path, link, ranks=2)
    # Each site's node ran an agent (a step of its own), the ranks reached it, and it
    # removed its folder when the job ended.
    for site in ("site0", "site1"):
        out = (tmp_path / f"{site}.out").read_text()
        assert f"host agent of {site} listening on unix:{agent_dirs[site]}/" in out, out[-3000:]
        assert "host agent unreachable" not in out, out[-3000:]
        assert not agent_dirs[site].exists(), out[-3000:]
