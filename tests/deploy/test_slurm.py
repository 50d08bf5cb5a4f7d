"""Slurm for real: the templates of deploy/slurm/ submitted unchanged with sbatch to a
cluster of four slurmd nodes that the test runs itself on this machine
(tests/slurm_cluster.py): munged and slurmctld from Debian's slurm-wlm and munge, which
`scripts/install.sh --dev` installs when root, and a slurmd in each node's own network
and UTS namespace. The nodes are two sites of two nodes each, one partition a site, and
every byte between the sites crosses one emulated link. Every test trains two sites
to identical replicas; the last loses a node mid-job and gets the site back through
Slurm's requeue.

The nodes have no GPUs, so each job is submitted as the templates' headers say for CPU
nodes: `--gpus-per-node=0` and the CPU settings on the sbatch command line, which
override the scripts' #SBATCH lines (GPU counts, 64 CPUs per task), and the partition
of its site (as a user names a cluster's).

Four nodes, not three: each site spans two nodes, so both run the multi-node path
(a head node serving the coordinator, a second node dialing it), and sites never share
a node, so the templates' default ports serve, as in two real datacenters.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from slurm_cluster import SlurmCluster, missing_tools

from isthmus.sim import LinkSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SPEC = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=1e9)
COORDINATOR_PORT = 7070  # the templates' default: each node has a network of its own
JOB_TIMEOUT_S = 300  # beyond sync.timeout_s: a site that gives up says why first
SITES = ("site0", "site1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    # As root (CI), Slurm must be there: install.sh put it there, and a missing tool is
    # a failure. Anyone else cannot run its daemons or namespaces: skip, saying why.
    if os.geteuid() != 0:
        pytest.skip("the Slurm test runs slurmctld, slurmd and namespaces as root (CI does)")
    missing = missing_tools()
    assert not missing, (
        f"{missing} missing: `bash scripts/install.sh --dev` as root apt-installs slurm-wlm, "
        "munge, iproute2 and iptables"
    )
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), SPEC)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def write_job(path: Path, cluster: SlurmCluster, certs: Path, *extra: str, steps: int = 3) -> Path:
    """A job of site0 and site1 whose coordinators are on each site's first node; its
    lanes and coordinators listen beyond loopback, so TLS and the token are on."""
    heads = {s: next(n.address for n in cluster.nodes if n.site == s) for s in SITES}
    coordinators = ", ".join(f'{s} = "{heads[s]}:{COORDINATOR_PORT}"' for s in SITES)
    path.write_text(
        "\n".join(
            [
                "[job]", f"steps = {steps}",
                "[model]", 'preset = "tiny"',
                "[run]",
                'log_level = "info"',  # the ranks' timeline, should a job fail
                "eval_batches = 1",  # no test here reads the held-out loss
                # Six processes importing torch at once on a loaded 2-core machine
                # took 110 s to reach their coordinators (the default deadline is
                # 120); a multi-node job here starts eight.
                "[sync]", "timeout_s = 240",
                "[security]", "require_tls = true", "require_token = true",
                f'certs_dir = "{certs}"',
                "[cluster]", f"coordinators = {{ {coordinators} }}",
                *extra,
            ]
        )
        + "\n"
    )  # fmt: skip
    return path


def job_env() -> dict[str, str]:
    """What the submitter's shell has: this interpreter's `isthmus` first on PATH
    (sbatch --export=ALL hands the environment to the job)."""
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def submit(cluster: SlurmCluster, script: str, tmp_path: Path, site: str, *options: str) -> str:
    return cluster.sbatch(
        script,
        f"--partition={site}",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        f"--chdir={tmp_path}",
        f"--output={tmp_path / f'{site}.out'}",
        *options,
        env=job_env(),
    )


class LinkCounters:
    """What crossed the link between the sites from now on."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster = cluster
        self.start = self._now()

    def _now(self) -> dict[str, int]:
        stats = self.cluster.wan.links["site0-site1"].stats()
        return {
            **{d: stats[d]["bytes_delivered"] for d in ("a_to_b", "b_to_a")},
            "refused": self.cluster.wan.refused,
        }

    def since(self) -> dict[str, int]:
        now = self._now()
        return {key: now[key] - self.start[key] for key in now}


def assert_identical_replicas(tmp_path: Path, link: LinkCounters, ranks: int) -> None:
    """Every rank of both sites (their results in the templates' run folders,
    runs/JOB_ID) ends with one parameter digest, and their lanes' bytes crossed the
    link: a_to_b is what site0 sent site1, and the relay counts every byte it
    forwarded, so at least what site0's lanes sent (each rank's bytes_sent is its
    site's total), and site1's the other way."""
    results = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/sites/*/rank*.json")]
    assert sorted((r["site"], r["rank"]) for r in results) == [
        (site, rank) for site in SITES for rank in range(ranks)
    ], results
    assert len({r["digest"] for r in results}) == 1, results
    sent = {r["site"]: r["bytes_sent"] for r in results if r["rank"] == 0}
    crossed = link.since()
    assert sent["site0"] > 0 and sent["site1"] > 0, sent
    assert crossed["a_to_b"] >= sent["site0"] and crossed["b_to_a"] >= sent["site1"], (
        crossed,
        sent,
    )
    # The relay resets a connection addressed to no node of the other site: a lane
    # advertised at an address the peers cannot reach it at.
    assert crossed["refused"] == 0, crossed


def test_two_sites_as_two_slurm_jobs_of_site_sbatch(cluster, tmp_path, job_dir):
    """One node a site (each site's first), each job.toml naming its site's lane
    address, as the template's header says."""
    link = LinkCounters(cluster)
    jobs = []
    for site in SITES:
        head = next(n for n in cluster.nodes if n.site == site)
        job = write_job(
            tmp_path / f"job-{site}.toml", cluster, job_dir, f'lane_host = "{head.address}"'
        )
        export = f"ALL,ISTHMUS_SITE={site},ISTHMUS_JOB={job},ISTHMUS_DEVICE=cpu"
        jobs.append(
            submit(
                cluster,
                "site.sbatch",
                tmp_path,
                site,
                f"--nodelist={head.name}",
                f"--export={export},ISTHMUS_RANKS_PER_SITE=1",
            )
        )
    cluster.wait(jobs, tmp_path, JOB_TIMEOUT_S)
    for site in SITES:  # `isthmus site` compared the final digests itself
        assert "replicas            identical" in (tmp_path / f"{site}.out").read_text()
    assert_identical_replicas(tmp_path, link, ranks=1)


def test_two_sites_of_two_nodes_as_two_slurm_jobs_of_site_multinode_sbatch(
    cluster, tmp_path, job_dir
):
    """Each site a job of two nodes, one `isthmus site` a node: the first node serves
    the coordinator, each node runs its rank and its own host agent, and each rank's
    lane is advertised at its own node's address."""
    link = LinkCounters(cluster)
    job = write_job(tmp_path / "job.toml", cluster, job_dir, 'lane_host = "0.0.0.0"')
    export = f"ALL,ISTHMUS_JOB={job},ISTHMUS_DEVICE=cpu,ISTHMUS_RANKS_PER_NODE=1"
    jobs = [
        submit(
            cluster,
            "site-multinode.sbatch",
            tmp_path,
            site,
            "--nodes=2",
            "--ntasks-per-node=1",
            f"--export={export},ISTHMUS_SITE={site}",
        )
        for site in SITES
    ]
    cluster.wait(jobs, tmp_path, JOB_TIMEOUT_S)
    assert_identical_replicas(tmp_path, link, ranks=2)
    for site, job_id in zip(SITES, jobs, strict=True):
        out = (tmp_path / f"{site}.out").read_text()
        run_dir = tmp_path / "runs" / job_id
        # Node 0 speaks for the site; node 1 ran its own rank and said so.
        assert "replicas            identical" in out, out[-3000:]
        assert f"{site} node 1: ranks [1] ended" in out, out[-3000:]
        # Each node advertised its lanes at its own address, the one the other site
        # reaches it at (node 0: the first node of the sorted node list).
        nodes = [n for n in cluster.nodes if n.site == site]
        for k, node in enumerate(nodes):
            config = tomllib.loads((run_dir / f"config-{site}-node{k}.toml").read_text())
            assert config["cluster"]["advertise_host"] == node.address, (k, config["cluster"])
        # Each node ran its own host agent, and its rank reached it: node 0's agent
        # carried one rank (its own), and no rank went around an agent.
        summary = json.loads((run_dir / "sites" / site / "summary.json").read_text())
        assert summary["host_agents"][site]["ranks"] == 1, summary["host_agents"]
        for log in run_dir.glob(f"logs/{site}-rank*.log"):
            text = log.read_text()
            assert "calling the coordinator" not in text and "no host agent" not in text, log
        assert not (run_dir / f"rank-secret-{site}").exists()  # the job removed it


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
