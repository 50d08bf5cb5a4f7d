"""Secure by default (issue 14, row 12): a site that would listen beyond loopback
without mutual TLS and the job token refuses to start, unless --insecure."""

from __future__ import annotations

import subprocess

import pytest
from helpers import ISTHMUS, assert_one_line_error, run_cli

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.security.exposure import check_exposure, is_loopback

pytestmark = pytest.mark.timeout(60)


def test_a_site_exposed_without_tls_and_token_refuses_to_start_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    exposed = [
        *("--set", "cluster.lane_host=0.0.0.0", "--set", "cluster.advertise_host=10.0.0.5"),
        *("--set", "cluster.coordinators.site1=127.0.0.1:9", "--run-dir", str(run_dir)),
    ]
    result = run_cli("site", "--site", "site0", *exposed, timeout=60)
    assert_one_line_error(
        result, "site0 would serve its lanes on 0.0.0.0 (cluster.lane_host)", "--insecure"
    )
    assert not run_dir.exists()  # refused before anything was made
    coordinator = run_cli(
        "coordinator", "--site", "site0", "--listen", "10.9.8.7:0", "--peer", "site1=127.0.0.1:9",
        timeout=60,
    )  # fmt: skip
    assert_one_line_error(coordinator, "its coordinator on 10.9.8.7", "security.require_tls")


def test_insecure_runs_an_exposed_coordinator_and_says_so_at_every_start():
    command = [*ISTHMUS, "coordinator", "--site", "site0", "--listen", "0.0.0.0:0"]
    command += ["--peer", "site1=127.0.0.1:9", "--insecure"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("coordinator site0 listening on 0.0.0.0:"), line
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "warning: --insecure: site0 serves its coordinator on 0.0.0.0" in err


def exposed_with(*security: str):
    """A job whose lanes listen on every address, with ``security`` settings."""
    return load_config(
        overrides=["cluster.lane_host=0.0.0.0", "cluster.advertise_host=h", *security]
    )


def test_exposure_rules(job_dir):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", ""))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "site0.example.net"))
    exposed = exposed_with()
    default = load_config()
    check_exposure(default.security, default.cluster, "site0", "127.0.0.1")  # all on loopback
    with pytest.raises(ConfigError, match="security.require_tls and security.require_token"):
        check_exposure(exposed.security, exposed.cluster, "site0", "127.0.0.1")
    token = ["security.require_token=true", f"security.certs_dir={job_dir}"]
    secured = exposed_with("security.require_tls=true", *token)
    check_exposure(secured.security, secured.cluster, "site0", "0.0.0.0")
    token_only = exposed_with(*token)
    with pytest.raises(ConfigError, match="without security.require_tls:"):
        check_exposure(token_only.security, token_only.cluster, "site0", "127.0.0.1")
