"""`isthmus site` once a node for a site on several nodes (``--nodes``, ``--node-rank``),
here two launchers on this machine's loopback standing for two nodes: the launcher the
Slurm and Kubernetes templates run on each node (tests/deploy/test_slurm.py and
tests/deploy/test_k8s_pods.py run it across network namespaces)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ISTHMUS, assert_one_line_error, run_cli

from isthmus.deploy.chaos.ports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def write_job(tmp_path, ranks: int = 2) -> str:
    p0, p1 = free_ports(2)
    path = tmp_path / "job.toml"
    path.write_text(
        "\n".join(
            [
                "[job]",
                "steps = 4",
                "[topology]",
                f"ranks_per_site = {ranks}",
                "[model]",
                'preset = "tiny"',
                "[run]",
                "eval_batches = 1",
                "[sync]",
                "timeout_s = 240",  # five ranks' imports at once on a loaded 2-core host
                "[cluster]",
                f'coordinators = {{ site0 = "127.0.0.1:{p0}", site1 = "127.0.0.1:{p1}" }}',
            ]
        )
        + "\n"
    )
    return str(path)


def write_secret(tmp_path):
    secret = tmp_path / "rank-secret"
    secret.touch(mode=0o600)
    secret.write_text(os.urandom(32).hex())
    return str(secret)


def node_args(job: str, secret: str, node: int, master_port: int, run_dir) -> list[str]:
    return [
        "site", "--config", job, "--site", "site1", "--nodes", "2", "--node-rank", str(node),
        "--master-addr", "127.0.0.1", "--master-port", str(master_port),
        "--rank-secret-file", secret, "--run-dir", str(run_dir), "--quiet",
        # A host alone: the coordinator binds it on the port cluster.coordinators names.
        "--listen", "127.0.0.1",
    ]  # fmt: skip


def test_a_site_on_two_nodes_trains_with_a_site_on_one_to_identical_replicas(tmp_path):
    job, secret = write_job(tmp_path), write_secret(tmp_path)
    (master_port,) = free_ports(1)
    run0, run1 = tmp_path / "run0", tmp_path / "run1"
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    site0 = subprocess.Popen(
        [*ISTHMUS, "site", "--config", job, "--site", "site0", "--run-dir", str(run0), "--quiet"],
        **popen,
    )
    second = subprocess.Popen([*ISTHMUS, *node_args(job, secret, 1, master_port, run1)], **popen)
    first = run_cli(*node_args(job, secret, 0, master_port, run1))
    out1, err1 = second.communicate(timeout=120)
    out0, err0 = site0.communicate(timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, err1[-3000:]
    assert site0.returncode == 0, err0[-3000:]
    # Node 0 speaks for the site: its summary, and every site's final digest.
    assert "replicas            identical" in first.stdout, first.stdout
    assert "replicas            identical" in out0
    assert "site1 node 1: ranks [1] ended" in out1, out1 + err1[-2000:]
    results = [json.loads(p.read_text()) for p in sorted(run1.glob("sites/site1/rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    assert len({r["digest"] for r in results}) == 1
    # Each node wrote its own resolved config and ran its own host agent.
    assert (run1 / "config-site1-node0.toml").exists()
    assert (run1 / "config-site1-node1.toml").exists()
    summary = json.loads((run1 / "sites" / "site1" / "summary.json").read_text())
    assert summary["host_agents"]["site1"]["ranks"] == 1
    assert summary["host_agents"]["site1"]["votes"] >= 4
    for log in run1.glob("logs/site1-rank*.log"):
        assert "calling the coordinator" not in log.read_text(), log  # went around it


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--nodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"], "--rank-secret-file"),
        (["--nodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "--node-rank"),
        (["--nodes", "3", "--master-addr", "127.0.0.1"], "cannot share evenly"),
        (["--nodes", "2", "--rank-secret-file", "SECRET"], "--master-addr"),
    ],
)
def test_a_node_that_cannot_hold_its_share_is_refused_before_it_writes(tmp_path, flags, needle):
    job, secret = write_job(tmp_path), write_secret(tmp_path)
    flags = [secret if f == "SECRET" else f for f in flags]
    run_dir = tmp_path / "run"
    result = run_cli(
        "site", "--config", job, "--site", "site1", "--run-dir", str(run_dir), *flags, timeout=60
    )
    assert_one_line_error(result, needle)
    assert not run_dir.exists()
