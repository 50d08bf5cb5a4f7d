"""`isthmus site` in two shells: each site launched on its own, as operators would."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest
from helpers import ISTHMUS, assert_one_line_error, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def write_job(tmp_path, **extra: str) -> str:
    p0, p1 = free_ports(2)
    lines = [
        "[job]",
        "steps = 5",
        "[model]",
        'preset = "tiny"',
        "[cluster]",
        f'coordinators = {{ site0 = "127.0.0.1:{p0}", site1 = "127.0.0.1:{p1}" }}',
    ]
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_two_sites_started_separately_train_to_identical_replicas(tmp_path):
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [*ISTHMUS, "site", "--config", job, "--site", "site0", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)  # the second operator is a little late; the first one waits
    second = run_cli("site", "--config", job, "--site", "site1", "--run-dir", str(run_dir))
    out0, err0 = first.communicate(timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert first.returncode == 0, err0[-2000:]
    assert "waiting for site1" in err0 and "s left" in err0
    for out in (out0, second.stdout):
        assert "replicas            identical" in out
    s0 = json.loads((run_dir / "sites" / "site0" / "summary.json").read_text())
    s1 = json.loads((run_dir / "sites" / "site1" / "summary.json").read_text())
    assert s0["digests"] == s1["digests"] and set(s0["digests"]) == {"site0", "site1"}
    assert len(set(s0["digests"].values())) == 1


def test_a_site_without_its_peers_address_is_told_how_to_set_it(tmp_path):
    result = run_cli("site", "--site", "site0", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert_one_line_error(result, "cluster.coordinators has no address for ['site1']")


def test_a_lonely_site_gives_up_with_a_countdown_and_one_line(tmp_path):
    job = write_job(tmp_path)
    result = run_cli(
        "site", "--config", job, "--site", "site0", "--set", "sync.timeout_s=6", timeout=120
    )
    assert_one_line_error(result, "timed out after 6s joining the job", "site1")
    assert "waiting for site1" in result.stderr
