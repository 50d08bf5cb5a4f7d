"""deploy/k8s/site.yaml as shipped, run as Kubernetes would run it: two sites of two pods.

No cluster can be installed here. The manifests are made by docs/launch.md's own
Kubernetes lines (all but kubectl's), filled in as its text says (a job into the
ConfigMap, the files of `isthmus certs` into the Secret), and every pod of both sites'
StatefulSets runs its exact command, arguments and environment, with its volumes and the
names it looks up, in a network namespace of its own (tests/kubelet.py). The sites are
joined by an emulated WAN (`TransparentWan`, `nodes=[2, 2]`) that carries traffic to
every pod IP of the other site and nothing else: what the template asks of the network
between the sites' clusters (docs/clusters.md, "Kubernetes"). A lane advertised at
another pod's address, or a Service name that leads nowhere, fails the run.

Needs root (network, mount and UTS namespaces, iptables), as CI is; skipped with the
reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import yaml
from helpers import ROOT, root_wan
from kubelet import Kubelet, Pod, objects, only

from isthmus.sim import LinkSpec
from isthmus.sim.transparent import TransparentWan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

SITES = ("site0", "site1")
SPEC = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=1e9)
DEADLINE_S = 300  # four launchers and their ranks importing torch on a loaded 2-core machine
TOOLS = ("unshare", "mount", "hostname", "sed", "bash", "isthmus")

# A user's job, put into the ConfigMap as the template's comment says: two CPU ranks a
# site (one a pod), the tiny model, a few steps. Its [cluster] and [security] are the
# shipped job's (test_the_test_job_keeps_the_shipped_network_and_security checks).
JOB = """\
[job]
steps = 4
[topology]
sites = 2
ranks_per_site = 2
device = "cpu"
[model]
preset = "tiny"
[train]
batch_size = 4
seq_len = 64
[sync]
timeout_s = 240
[run]
digest_every = 2
tensorboard = false
eval_batches = 1
[cluster]
coordinators = { site0 = "isthmus-site0:7070", site1 = "isthmus-site1:7070" }
lane_host = "0.0.0.0"
lane_port_base = 7100
[security]
certs_dir = "/etc/isthmus/tls"
require_tls = true
require_token = true
"""

# `isthmus site` up to its launch, with the launch replaced by a report of what it
# would have run: the arguments parsed, the config loaded and checked, the node placed.
DRY_RUN = """\
import json, sys
import isthmus.deploy.commands.site as command
import isthmus.deploy.launch.site as launch
from isthmus.deploy import cli

class Launch:
    def __init__(self, config, site, **kwargs):
        self.config, self.site, self.place = config, site, kwargs["place"]

    def run(self):
        c, place = self.config, self.place
        node = place.slice(c, self.site)
        print(json.dumps({
            "ranks": c.ranks_of(self.site), "device": c.topology.device,
            "lane_host": c.cluster.lane_host, "advertise_host": c.cluster.advertise_host,
            "metrics_port": c.run.metrics_port, "tls": c.security.require_tls,
            "token": c.security.require_token, "nodes": place.nodes,
            "node_rank": place.node_rank, "master": node.master, "first": node.first,
            "count": node.count, "listen": place.listen,
        }), flush=True)
        return {"ranks": list(range(node.first, node.first + node.count))}

launch.SiteJob = Launch
command.run_job = lambda job, heading: job.run() and 0
assert sys.argv[1] == "isthmus", sys.argv
sys.exit(cli.main(sys.argv[2:]))
"""


def kubernetes_lines() -> str:
    """docs/launch.md's Kubernetes block, but its kubectl lines (no cluster here: the
    kubelet below runs what they would apply)."""
    text = (ROOT / "docs" / "launch.md").read_text()
    start = text.index("**Kubernetes**")
    section = text[start : text.index("\n**", start)]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "docs/launch.md's Kubernetes paragraph has no bash block"
    lines = block.group(1).splitlines()
    assert any(line.startswith("kubectl apply -f site0.yaml") for line in lines), lines
    return "\n".join(line for line in lines if not line.startswith("kubectl "))


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A checkout where a user ran those lines: certs/, site0.yaml and site1.yaml."""
    for tool in TOOLS:
        assert shutil.which(tool), f"{tool} missing: install the dev extra (scripts/install.sh)"
    work = tmp_path_factory.mktemp("k8s-user")
    (work / "deploy").symlink_to(ROOT / "deploy")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", kubernetes_lines()],
        cwd=work, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return work


def filled(user: Path, site: str, job: str | None) -> list[dict]:
    """SITE.yaml filled in as docs/launch.md says: ``job`` (None: the shipped one) in the
    ConfigMap, the Secret's keys from certs/."""
    docs = list(yaml.safe_load_all((user / f"{site}.yaml").read_text()))
    if job is not None:
        data = only(docs, "ConfigMap")["data"]
        assert set(data) == {"job.toml"}, data
        data["job.toml"] = job
    secret = only(docs, "Secret")["stringData"]
    files = {
        "ca.crt": "ca.crt", f"{site}.crt": f"{site}.crt", f"{site}.key": f"{site}.key",
        "token": "token", "rank-secret": f"{site}.rank-secret",
    }  # fmt: skip
    assert set(secret) == set(files), secret  # the test fills what the Secret has, no more
    for key, name in files.items():
        secret[key] = (user / "certs" / name).read_text()
    return docs


@pytest.fixture(scope="module")
def wan() -> Iterator[TransparentWan]:
    with root_wan("k", SPEC, [2, 2], "network, mount and UTS namespaces") as wan:
        yield wan


def tails(kubelet: Kubelet, logs: Path) -> str:
    parts = []
    for log in sorted(logs.glob("*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}")
    for pods in kubelet.pods.values():
        for pod in pods:
            run = pod.folder / "volumes" / "runs" / "run" / "logs"
            for log in sorted(run.glob("*.log")) if run.is_dir() else []:
                parts.append(
                    f"--- {pod.name} {log.name}\n{log.read_text(errors='replace')[-2500:]}"
                )
    return "\n".join(parts)


def run_pods(kubelet: Kubelet, pods: list[Pod], logs: Path, wrap: tuple[str, ...] = ()) -> None:
    """Start the pods at once (podManagementPolicy Parallel) and wait for all to end
    well; the first to fail ends the rest."""
    logs.mkdir(exist_ok=True)
    running = {p.name: kubelet.start(p, logs / f"{p.name}.log", wrap) for p in pods}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in running.values()):
            failed = {n: p.returncode for n, p in running.items() if p.poll() not in (None, 0)}
            assert not failed, f"{failed}\n{tails(kubelet, logs)}"
            assert time.monotonic() < deadline, (
                f"not done in {DEADLINE_S} s\n{tails(kubelet, logs)}"
            )
            time.sleep(0.2)
        failed = {n: p.returncode for n, p in running.items() if p.returncode != 0}
        assert not failed, f"{failed}\n{tails(kubelet, logs)}"
    finally:
        for process in running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def shipped_job() -> dict:
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "site.yaml").read_text())
    return tomllib.loads(only(list(docs), "ConfigMap")["data"]["job.toml"])


def test_the_test_job_keeps_the_shipped_network_and_security():
    ours, shipped = tomllib.loads(JOB), shipped_job()
    assert ours["cluster"] == shipped["cluster"]
    assert ours["security"] == shipped["security"]


def test_only_the_coordinator_is_published_to_peers_and_the_metrics_port_is_not(user):
    docs = filled(user, "site0", None)
    container = only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    metrics = next(a for a in container["args"] if a.startswith("run.metrics_port="))
    metrics_port = int(metrics.partition("=")[2])
    assert {"name": "metrics", "containerPort": metrics_port} in container["ports"]
    peers = [s for s in objects(docs, "Service") if s["spec"].get("clusterIP") != "None"]
    assert [s["metadata"]["name"] for s in peers] == ["isthmus-site0"]
    assert [p["port"] for p in peers[0]["spec"]["ports"]] == [7070]
    assert peers[0]["spec"].get("type", "ClusterIP") == "ClusterIP"
    headless = only(docs, "Service", "isthmus-site0-nodes")["spec"]
    assert headless["publishNotReadyAddresses"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    # The Secret beside the ConfigMap, not inside its folder (nor it in the Secret's).
    job, tls = Path(mounts["job"]), Path(mounts["tls"])
    assert job.parent == tls.parent and job != tls


def test_the_shipped_job_loads_with_the_statefulsets_exact_arguments(wan, user, tmp_path):
    """Issue 59's first contact: the ConfigMap's job as shipped, read by the StatefulSet's
    own command on each pod of a site, was refused (lanes on 0.0.0.0 without an advertised
    address). Here `isthmus site` runs on both pods of site0 up to where it would launch
    the 16 CUDA ranks this machine lacks."""
    manifests = {site: filled(user, site, None) for site in SITES}
    kubelet = Kubelet(manifests, wan.sites, tmp_path / "pods")
    pods = kubelet.pods["site0"]
    run_pods(kubelet, pods, tmp_path / "logs", wrap=(sys.executable, "-c", DRY_RUN))
    for pod in pods:
        lines = (tmp_path / "logs" / f"{pod.name}.log").read_text().splitlines()
        report = json.loads(next(line for line in lines if line.startswith("{")))
        assert report == {
            "ranks": 16, "device": "cuda", "lane_host": "0.0.0.0", "advertise_host": pod.ip,
            "metrics_port": 9400, "tls": True, "token": True, "nodes": 2,
            "node_rank": pod.index, "master": "isthmus-site0-0.isthmus-site0-nodes:29500",
            "first": 8 * pod.index, "count": 8, "listen": "0.0.0.0:7070",
        }  # fmt: skip


def test_two_sites_of_two_pods_each_train_to_identical_replicas(wan, user, tmp_path):
    manifests = {site: filled(user, site, JOB) for site in SITES}
    kubelet = Kubelet(manifests, wan.sites, tmp_path / "pods")
    pods = [pod for site in SITES for pod in kubelet.pods[site]]
    logs = tmp_path / "logs"
    run_pods(kubelet, pods, logs)
    digests = set()
    for pod in pods:
        argv = kubelet.argv(pod)
        run = kubelet.on_host(pod, argv[argv.index("--run-dir") + 1])
        # Each pod's volume holds its own rank's result: pod k ran rank k of its site.
        results = [json.loads(p.read_text()) for p in run.glob(f"sites/{pod.site}/rank*.json")]
        assert [(r["site"], r["rank"]) for r in results] == [(pod.site, pod.index)], results
        digests.add(results[0]["digest"])
        # Its lanes were advertised at its own IP, where the other site reached them.
        config = tomllib.loads((run / f"config-{pod.site}-node{pod.index}.toml").read_text())
        assert config["cluster"]["advertise_host"] == pod.ip
    assert len(digests) == 1, digests
    for site in SITES:
        head = (logs / f"isthmus-{site}-0.log").read_text()
        assert "replicas            identical" in head, head[-3000:]
    tail = (logs / "isthmus-site0-1.log").read_text()
    assert "site0 node 1: ranks [1] ended" in tail, tail[-3000:]
    # Both ways across the WAN, and nothing addressed where no pod is.
    stats = wan.links["site0-site1"].stats()
    assert stats["a_to_b"]["bytes_delivered"] > 0 and stats["b_to_a"]["bytes_delivered"] > 0
    assert wan.refused == 0
