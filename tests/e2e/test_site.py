"""`isthmus site` in two shells: each site launched on its own, as operators would."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess

import grpc
import pytest
from helpers import ISTHMUS, ROOT, assert_one_line_error, run_cli, wait_until

from isthmus.deploy.chaos.ports import free_ports
from isthmus.deploy.cli import TEARDOWN_S
from isthmus.deploy.config.job import JobConfig, load_config
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def write_job(tmp_path, **extra: str) -> str:
    p0, p1 = free_ports(2)
    lines = [
        "[job]",
        "steps = 5",
        "[model]",
        'preset = "tiny"',
        # The held-out loss (read by no test here) on one batch, not 16: seconds less.
        "[run]",
        "eval_batches = 1",
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
    # The second operator is late: site0 says whom it waits for, and how long it will.
    early: list[str] = []
    while not (line := first.stderr.readline()).startswith("waiting for site1"):
        assert line, f"site0 exited: {''.join(early)[-2000:]}"
        early.append(line)
    assert line.rstrip().endswith("s left"), line
    # Issue 33, rows 2 and 6: while site0 waits, a stranger on the machine joins in
    # site1's name and registers site0's rank 0. Both sites run with the user's job
    # token (deploy/security/token.py), so neither call reaches a handler.
    refused = forged_calls(load_config(job))
    assert refused == ["UNAUTHENTICATED"] * 3, refused
    second = run_cli("site", "--config", job, "--site", "site1", "--run-dir", str(run_dir))
    out0, err0 = first.communicate(timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert first.returncode == 0, err0[-2000:]
    for out in (out0, second.stdout):
        assert "replicas            identical" in out
    s0 = json.loads((run_dir / "sites" / "site0" / "summary.json").read_text())
    s1 = json.loads((run_dir / "sites" / "site1" / "summary.json").read_text())
    assert s0["digests"] == s1["digests"] and set(s0["digests"]) == {"site0", "site1"}
    assert len(set(s0["digests"].values())) == 1
    # Issue 33, item 1: what the sites wrote is their owner's alone.
    for path in (run_dir / "config-site0.toml", run_dir / "sites" / "site0" / "summary.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((run_dir / "sites" / "site1").stat().st_mode) == 0o700


def forged_calls(config: JobConfig) -> list[str]:
    """A Join in site1's name, site0's rank 0 registered and a membership asked at site0,
    without the token, with the job's fingerprint (its config is readable): the status
    of each."""
    fingerprint = pb.JobFingerprint(fields=config.fingerprint())
    address = config.cluster.coordinators["site0"]
    calls = [
        lambda stub: stub.Join(
            pb.JoinRequest(
                site=pb.SiteInfo(name="site1", coordinator_address="127.0.0.1:9"),
                fingerprint=fingerprint,
                ready=True,
            ),
            timeout=10,
        ),
        lambda stub: stub.RegisterRank(
            pb.RegisterRankRequest(
                site="site0",
                rank=0,
                world_size=2,
                lane_address="127.0.0.1:9",
                fingerprint=fingerprint,
                rank_key="k" * 32,
            ),
            timeout=10,
        ),  # fmt: skip
        lambda stub: stub.GetMembership(pb.GetMembershipRequest(), timeout=10),
    ]
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for call in calls:
            try:
                call(stub)
                out.append("OK")
            except grpc.RpcError as exc:
                out.append(exc.code().name)
    return out


def test_a_site_without_its_peers_address_is_told_how_to_set_it(tmp_path):
    result = run_cli("site", "--site", "site0", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert_one_line_error(result, "cluster.coordinators has no address for ['site1']")


def test_a_lonely_site_gives_up_with_a_countdown_and_one_line(tmp_path):
    job = write_job(tmp_path)
    result = run_cli(
        "site", "--config", job, "--site", "site0", "--set", "sync.timeout_s=3", timeout=120
    )
    assert_one_line_error(result, "timed out after 3s joining the job", "site1")
    assert "waiting for site1" in result.stderr


def test_the_readme_quick_start_runs_as_written(tmp_path):
    """README, "Two sites in two shells": wan up, then one `isthmus site` per shell."""
    readme = (ROOT / "README.md").read_text()
    commands = [
        "isthmus wan up docs/quickstart/two-sites.toml --proxy-port 7500",
        "isthmus site --config docs/quickstart/job.toml --site site0",
        "isthmus site --config docs/quickstart/job.toml --site site1",
    ]
    for command in commands:
        assert command in readme, f"README no longer shows: {command}"
    argv = [[*ISTHMUS, *c.split()[1:]] for c in commands]
    wan = subprocess.Popen(argv[0], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for line in wan.stdout:  # wait until the links are up
            if line.startswith("ready"):
                break
        sites = [
            subprocess.Popen(a, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for a in argv[1:]
        ]
        outputs = [p.communicate(timeout=240) for p in sites]
        for p, (out, err) in zip(sites, outputs, strict=True):
            assert p.returncode == 0, err[-2000:]
            assert "step 20/20" in err and "replicas            identical" in out
        # The cross-site traffic really crossed the emulated link.
        shown = subprocess.run(
            [*ISTHMUS, "wan", "show", "--control", "127.0.0.1:7407", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "site0-site1" in shown.stdout
    finally:
        wan.terminate()
        wan.wait(10)


def test_a_site_signalled_twice_while_its_ranks_die_exits_and_frees_its_port(tmp_path):
    """Issue 63: SIGTERM to a site's process group (its ranks die) under `timeout`,
    which hands its launcher a second SIGTERM a moment later, once cut the launcher's
    teardown short: it stayed up for minutes ("cannot schedule new futures after
    shutdown", then "joining again" forever), holding its coordinator's port. It now
    exits within the teardown's bound (deploy/cli.py, Interrupts), the port free."""
    job = write_job(tmp_path)
    run_dir = tmp_path / "run"
    sites = [
        subprocess.Popen(
            [
                "timeout",
                "600",
                *ISTHMUS,
                "site",
                "--config",
                job,
                "--site",
                site,
                "--run-dir",
                str(run_dir),
                "--steps",
                "5000",
                "--quiet",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a shell's job
        )  # fmt: skip
        for site in ("site0", "site1")
    ]
    try:
        metrics = run_dir / "sites" / "site1" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and metrics.read_text().strip(), "no step", 240)
        site1 = sites[1]
        os.killpg(site1.pid, signal.SIGTERM)  # timeout passes it on to the launcher again
        _, err = site1.communicate(timeout=TEARDOWN_S + 15)  # timeout waits for it
        assert "interrupted; everything this run started has been stopped" in err, err[-2000:]
        assert "cannot schedule new futures" not in err, err[-2000:]
        host, _, port = load_config(job).cluster.coordinators["site1"].rpartition(":")
        with socket.socket() as probe:
            # As a server binds (gRPC's too): connections in TIME_WAIT do not hold the
            # port, a listening process would.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
            probe.listen()
    finally:
        for process in sites:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
