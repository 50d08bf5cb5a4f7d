"""`isthmus probe`: real `probe serve` and `probe` processes across an emulated link
(sim/relay.py in this process), the host audit on a fake /proc/sys, the probe file in a
job (`wan.probe`) and in `isthmus plan --probe`, and bad input in one line.

Rates are low (40 Mbit/s, 10 Mbit/s a flow) so a busy 2-core machine keeps up; only
the bounds the emulator enforces are asserted (no rate above the spec, no RTT below
it), never a lower bound on throughput, except that 4 capped flows beat one."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ISTHMUS, assert_one_line_error, run_cli
from sockets import Server

from isthmus.deploy.config.job import load_config
from isthmus.deploy.launch.probe_audit import audit
from isthmus.sim import LinkSpec, RelayServer

RTT_MS = 20.0
LINK_GBIT, CAP_GBIT = 0.04, 0.01
# A flow may send one piece (64 KiB) beyond its cap after an idle stretch (the token
# bucket's depth, docs/wan.md): 15 % covers it over a 1 s phase.
BURST = 1.15
KEYS = ("rtt_ms", "gbit_1flow", "gbit_nflows", "per_flow_cap_gbit", "loss", "mtu", "congestion")


@contextlib.contextmanager
def probe_server(*args: str) -> Iterator[str]:
    """`isthmus probe serve` on a free port; its address."""
    process = subprocess.Popen(
        [*ISTHMUS, "probe", "serve", "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line + process.stderr.read()
        yield line.split()[-1]
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def capped_link(target: str) -> Iterator[str]:
    """A 20 ms, 40 Mbit/s link capping each flow at 10 Mbit/s, to ``target``; the
    address that reaches it across the link."""
    host, port = target.rsplit(":", 1)
    spec = LinkSpec.symmetric(
        latency_s=RTT_MS / 2e3, bandwidth_bps=LINK_GBIT * 1e9, per_flow_bps=CAP_GBIT * 1e9
    )
    with RelayServer() as relay:
        yield ":".join(map(str, relay.add_link("a-b", spec).add_forward(host, int(port))))


def bad_host(root: Path) -> Path:
    """A /proc/sys whose settings the audit should flag."""
    for name, value in {
        "net/ipv4/tcp_rmem": "4096 16384 32768",
        "net/ipv4/tcp_wmem": "4096 16384 4194304",
        "net/core/rmem_max": "16384",
        "net/ipv4/tcp_congestion_control": "cubic",
        "net/ipv4/tcp_slow_start_after_idle": "1",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(value + "\n")
    return root


def _check_link(link: dict) -> None:
    assert set(KEYS) <= set(link), link
    # The emulator never shortens a round trip; a busy machine may lengthen it a lot.
    assert RTT_MS <= link["rtt_ms"] < RTT_MS * 5, link
    assert link["gbit_1flow"] <= CAP_GBIT * BURST, link
    assert link["gbit_nflows"] <= LINK_GBIT * BURST, link
    # The cap is seen: 4 flows carry clearly more than one.
    assert link["per_flow_cap_gbit"] == link["gbit_1flow"], link
    assert 0 <= link["loss"] < 1, link  # the link loses nothing, but load delays pings


def test_probe_measures_a_capped_link_and_audits_the_host(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    with probe_server() as server, capped_link(server) as forward:
        fake = str(bad_host(tmp_path / "sys"))
        args = [forward, "--seconds", "1", "--flows", "4", "--json", str(out)]
        result = run_cli("probe", *args, "--sysctl-root", fake, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pings for 1 s" in result.stderr  # progress while it measures
    link = json.loads(out.read_text())["links"][0]
    _check_link(link)
    assert f"here -> {forward}" in result.stdout
    # (cubic is flagged only on a lossy link: a busy machine may make one look lossy.)
    settings = {f["setting"] for f in link["audit"]}
    want = {"net.ipv4.tcp_rmem", "net.core.rmem_max", "net.ipv4.tcp_slow_start_after_idle"}
    assert want <= settings and "net.ipv4.tcp_wmem" not in settings, link["audit"]
    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in result.stdout


def test_probe_of_a_jobs_sites_asks_each_pairs_first_site(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    out = tmp_path / "probe.json"
    with probe_server() as site0, probe_server() as site1, capped_link(site1) as forward:
        # site0's server at its coordinator's host and --port; site1's across the link.
        job.write_text('[cluster]\ncoordinators = { site0 = "127.0.0.1:7070" }\n')
        sites = ["--port", site0.rsplit(":", 1)[1], "--site", f"site1={forward}"]
        args = ["--seconds", "1", "--flows", "4", "--json", str(out)]
        result = run_cli("probe", "--config", str(job), *sites, *args, timeout=60)
    assert result.returncode == 0, result.stderr
    (link,) = json.loads(out.read_text())["links"]
    assert (link["from"], link["to"], link["target"]) == ("site0", "site1", forward)
    _check_link(link)
    assert "audit" in link  # site0's server audits its own host


def test_the_probe_file_sets_a_jobs_link_and_plans(tmp_path: Path) -> None:
    links = [
        {"rtt_ms": 20.0, "gbit_nflows": 4.0, "per_flow_cap_gbit": 1.0, "loss": 0.0},
        {"rtt_ms": 50.0, "gbit_nflows": 8.0, "per_flow_cap_gbit": None, "loss": 0.0},
    ]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"links": links}))
    wan = load_config(None, [f"wan.probe={path}"]).wan  # the slowest link governs
    assert (wan.latency_ms, wan.bandwidth_mbit, wan.per_flow_mbit, wan.probe) == (
        25,
        4000,
        1000,
        "",
    )
    plan = run_cli("plan", "--probe", str(path), "--json", timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "RTT 50.00 ms, 4,000 Mbit/s, 1,000 Mbit/s a flow" in plan.stderr
    inputs = json.loads(plan.stdout)["inputs"]
    assert (inputs["rtt_s"], inputs["bandwidth_bps"]) == (0.05, 4e9)
    path.write_text("{}")
    assert_one_line_error(run_cli("plan", "--probe", str(path)), "not an `isthmus probe --json`")


def test_the_audit_names_what_a_lossy_link_needs(tmp_path: Path) -> None:
    link = {"rtt_ms": 80.0, "gbit_nflows": 10.0, "per_flow_cap_gbit": None, "loss": 0.01}
    found = {f["setting"]: f["advice"] for f in audit([link], bad_host(tmp_path))}
    assert "bbr" in found["net.ipv4.tcp_congestion_control"]
    assert "holds one flow to 0.00164 Gbit/s at 80 ms" in found["net.ipv4.tcp_rmem"]
    assert "net.ipv4.tcp_wmem" in found  # 4 MiB: 0.21 Gbit/s at 80 ms
    link.update(rtt_ms=1.0, gbit_nflows=0.05, loss=0.0)
    (tmp_path / "net/ipv4/tcp_slow_start_after_idle").write_text("0\n")
    assert audit([link], tmp_path) == []  # 16 KiB of window carry 0.13 Gbit/s at 1 ms


def _refuse(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    conn.close()


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("probe", "nohost", timeout=30), "expected HOST:PORT")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # closed below: nothing listens there
    nothing = run_cli("probe", f"127.0.0.1:{free}", timeout=30)
    assert_one_line_error(nothing, "cannot reach a probe server")
    other = Server(_refuse)
    try:
        wrong = run_cli("probe", ":".join(map(str, other.address)), timeout=30)
    finally:
        other.close()
    assert_one_line_error(wrong, "is not an isthmus probe server")
    token = tmp_path / "token"
    token.write_text("sesame\n")
    with probe_server("--token-file", str(token)) as server:
        assert_one_line_error(run_cli("probe", server, timeout=30), "wrong or missing job token")
    job = tmp_path / "job.toml"
    job.write_text("[topology]\nsites = 2\n")
    assert_one_line_error(
        run_cli("probe", "--config", str(job), timeout=30), "no address for site0"
    )
    assert_one_line_error(run_cli("probe", "serve", timeout=30), "needs --listen")


@pytest.mark.parametrize("flows", ["0", "65"])
def test_flows_out_of_range(flows: str) -> None:
    assert_one_line_error(run_cli("probe", "127.0.0.1:1", "--flows", flows, timeout=30), "flows")
