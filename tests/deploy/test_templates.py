"""Cluster templates: Slurm scripts pass shellcheck, Kubernetes manifests pass a
schema check and their StatefulSet's arguments name what its volumes hold, the Dockerfile
passes hadolint. Their pods run in tests/deploy/test_k8s_pods.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from helpers import ROOT
from kubelet import expand, only

from isthmus.deploy.cli import build_parser

pytestmark = pytest.mark.timeout(120)


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} missing: install the dev extra (bash scripts/install.sh --dev)"
    return path


def test_slurm_scripts_pass_shellcheck():
    scripts = sorted((ROOT / "deploy" / "slurm").glob("*.sbatch"))
    assert len(scripts) == 2
    result = subprocess.run(
        [tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
    for script in scripts:
        text = script.read_text()
        assert "set -euo pipefail" in text and "#SBATCH" in text


@pytest.mark.parametrize("site", ["site0", "site1"])
def test_kubernetes_manifests_pass_the_schema_check(site, tmp_path):
    rendered = tmp_path / f"{site}.yaml"
    rendered.write_text(
        (ROOT / "deploy" / "k8s" / "site.yaml").read_text().replace("SITE_NAME", site)
    )
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(rendered)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered.read_text())}
    assert kinds == {"ConfigMap", "Secret", "Service", "StatefulSet"}


def test_the_statefulsets_arguments_name_what_its_volumes_hold():
    """The job in the ConfigMap, the rank secret and the certificates in the Secret, the
    node count and the first pod's name as the StatefulSet makes them. That the shipped
    job loads with exactly these arguments, and that the pods train, is run on the pods
    themselves by tests/deploy/test_k8s_pods.py (as root)."""
    rendered = (ROOT / "deploy" / "k8s" / "site.yaml").read_text().replace("SITE_NAME", "site0")
    docs = list(yaml.safe_load_all(rendered))
    statefulset = only(docs, "StatefulSet")
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    env = {"NODE_RANK": "1", "POD_IP": "10.0.0.7"}  # what the downward API gives pod 1
    argv = [expand(a, env) for a in (*container["command"], *container["args"])]
    assert argv[0] == "isthmus"
    args = build_parser().parse_args(argv[1:])
    assert (args.node_rank, args.advertise_host) == (1, "10.0.0.7")
    mounts = {m["name"]: Path(m["mountPath"]) for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    config = only(docs, "ConfigMap", volumes["job"]["configMap"]["name"])["data"]
    assert Path(args.config).parent == mounts["job"] and Path(args.config).name in config
    secret = only(docs, "Secret", volumes["tls"]["secret"]["secretName"])["stringData"]
    assert Path(args.rank_secret_file).parent == mounts["tls"]
    assert Path(args.rank_secret_file).name in secret
    job = tomllib.loads(config[Path(args.config).name])
    assert Path(job["security"]["certs_dir"]) == mounts["tls"]
    assert {"ca.crt", "site0.crt", "site0.key", "token"} <= set(secret)
    spec = statefulset["spec"]
    assert args.nodes == spec["replicas"]
    assert args.master_addr == f"{statefulset['metadata']['name']}-0.{spec['serviceName']}"
    assert job["topology"]["ranks_per_site"] % args.nodes == 0


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
