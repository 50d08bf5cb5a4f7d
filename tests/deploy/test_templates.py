"""Cluster templates: Slurm scripts pass shellcheck, Kubernetes manifests pass a
schema check, the Dockerfile passes hadolint, and the job config they carry loads."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import tomllib
import yaml
from helpers import ROOT

from isthmus.deploy.commands.certs import write_certs
from isthmus.deploy.config.job import load_config
from isthmus.deploy.security.exposure import check_exposure

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


def test_the_configmap_job_loads_and_the_statefulset_runs_it(tmp_path):
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "site.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["job.toml"]
    path = tmp_path / "job.toml"
    path.write_text(job)
    assert tomllib.loads(job)["cluster"]["lane_port_base"] == 7100
    certs = tmp_path / "tls"  # what the Secret mounts at /etc/isthmus/tls
    write_certs(certs, ["site0", "site1"])
    overrides = ["cluster.advertise_host=isthmus-site0.example.net"]
    assert tomllib.loads(job)["security"]["certs_dir"] == "/etc/isthmus/tls"
    config = load_config(path, [*overrides, f"security.certs_dir={certs}"])
    assert config.topology.ranks_per_site == 8
    # Lanes on every interface: the template turns on mutual TLS and the token, so the
    # site starts (docs/security.md), from the files the Secret holds.
    check_exposure(config, "site0", "0.0.0.0")
    secret = next(d for d in docs if d["kind"] == "Secret")["stringData"]
    assert set(secret) == {"ca.crt", "SITE_NAME.crt", "SITE_NAME.key", "token"}
    assert {"ca.crt", "site0.crt", "site0.key", "token"} <= {p.name for p in certs.iterdir()}
    stateful = next(d for d in docs if d["kind"] == "StatefulSet")
    command = stateful["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["isthmus", "site"]
    service_ports = {
        p["port"] for p in next(d for d in docs if d["kind"] == "Service")["spec"]["ports"]
    }
    assert set(range(7100, 7108)) <= service_ports  # one lane port per rank


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
