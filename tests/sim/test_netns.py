"""Transparent mode: unmodified TCP programs in per-site namespaces, across the relay.

These need root and iptables (CI runs as root and installs iptables); without them
every test fails with the reason. All traffic stays between the namespaces the tests
create, their veths and loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT
from measured import assert_rate

from isthmus.sim import LinkSpec, control_request
from isthmus.sim.netns import job_resources, require_tools, teardown
from isthmus.sim.transparent import TransparentWan

LATENCY_S = 0.010
BANDWIDTH_BPS = 100e6  # low enough that a busy 2-core CI box still keeps up
SPEC = LinkSpec.symmetric(latency_s=LATENCY_S, bandwidth_bps=BANDWIDTH_BPS)
PORT = 7000  # each namespace is fresh, so a fixed port is free
WAN = [sys.executable, "-m", "isthmus.deploy.commands.wan"]  # `isthmus wan`, without torch
# Timed endpoints run at the relay pumps' priority (sim/clock.py), as in
# tests/sim/test_wan_fidelity.py: other jobs on a shared machine then decide no figure.
NICE = ["nice", "-n", "-10"]

SERVER = r"""
import socket, sys, threading
def serve(conn):
    with conn:
        if conn.recv(1) == b"e":  # echo until EOF
            while data := conn.recv(1 << 16):
                conn.sendall(data)
        else:  # sink: count bytes until EOF, answer with the count
            total = 0
            while data := conn.recv(1 << 16):
                total += len(data)
            conn.sendall(str(total).encode())
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""

CLIENT = r"""
import json, socket, statistics, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {}
with socket.create_connection((host, port), timeout=30) as c:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"e")
    rtts = []
    for _ in range(101):
        t = time.perf_counter()
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        rtts.append(time.perf_counter() - t)
    out["rtt_s"] = statistics.median(rtts[1:])
    out["rtt_min_s"] = min(rtts[1:])
with socket.create_connection((host, port), timeout=30) as c:
    if not nbytes:  # round trips only
        print(json.dumps(out))
        sys.exit(0)
    c.sendall(b"s")
    block = bytes(1 << 16)
    t = time.perf_counter()
    for _ in range(nbytes >> 16):
        c.sendall(block)
    c.shutdown(socket.SHUT_WR)
    out["counted"] = int(c.recv(64))
    out["bulk_s"] = time.perf_counter() - t
print(json.dumps(out))
"""

PROBE = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
        c.sendall(b"ex")  # echo mode, then one byte to echo
        print("answered" if c.recv(1) else "closed")
except OSError as e:
    print(type(e).__name__)
"""


def job_name(tag: str) -> str:
    return f"t{os.getpid() % 100000}{tag}"


@pytest.fixture(scope="module", autouse=True)
def _root_and_iptables() -> None:
    require_tools()  # fails every test with the reason: not root, or a tool missing


@pytest.fixture(scope="module")
def wan():
    with TransparentWan(job_name("a"), 2, SPEC) as wan:
        server = subprocess.Popen(
            [*wan.sites[1].exec_prefix, sys.executable, "-c", SERVER, "0.0.0.0", str(PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            yield wan
        finally:
            server.kill()
            server.wait()


def in_site(wan: TransparentWan, site: int, script: str, *args: object) -> str:
    done = subprocess.run(
        [*wan.sites[site].exec_prefix, sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_rtt_and_throughput_match_the_link(wan: TransparentWan) -> None:
    nbytes = 8 << 20
    got = json.loads(in_site(wan, 0, CLIENT, wan.sites[1].address, PORT, nbytes))
    rtt = SPEC.rtt_s
    assert got["rtt_s"] == pytest.approx(rtt, rel=0.10), got
    assert got["counted"] == nbytes
    # The count comes back after the last byte arrived: one RTT on top of serialization.
    mbit = nbytes * 8 / (got["bulk_s"] - rtt) / 1e6
    assert mbit == pytest.approx(BANDWIDTH_BPS / 1e6, rel=0.10), got
    stats = wan.links["site0-site1"].stats()
    # It really crossed the link (the counter may trail the last write by a piece).
    assert stats["a_to_b"]["bytes_delivered"] >= 0.9 * nbytes


def test_connections_outside_the_job_are_reset(wan: TransparentWan) -> None:
    a, b = wan.sites
    # A server in the root namespace, on site1's gateway: routable from site0, but
    # not a site of the job, so the relay must refuse rather than reach it.
    server = socket.socket()
    server.bind((b.gateway, 0))
    server.listen()
    server.settimeout(0.5)
    refused = wan.refused
    try:
        port = server.getsockname()[1]
        for host, to in ((b.gateway, port), (a.gateway, port), (b.address[:-1] + "9", PORT)):
            assert in_site(wan, 0, PROBE, host, to) in ("ConnectionResetError", "closed"), host
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert wan.refused == refused + 3
    # A site's own address is not reached through the link either (it is local there).
    assert in_site(wan, 1, PROBE, b.address, PORT) == "answered"


def test_udp_does_not_cross(wan: TransparentWan) -> None:
    receiver = subprocess.Popen(
        [
            *wan.sites[1].exec_prefix,
            sys.executable,
            "-c",
            "import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.bind(('0.0.0.0', 7001)); s.settimeout(2); print('ready', flush=True)\n"
            "try: print(s.recv(10))\nexcept TimeoutError: print('nothing')",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdout.readline().strip() == "ready"
    send = "import socket,sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', (sys.argv[1], 7001))"  # fmt: skip
    in_site(wan, 0, send, wan.sites[1].address)
    assert receiver.communicate(timeout=10)[0].strip() == "nothing"


def nothing_left(job: str) -> None:
    assert job_resources(job) == {"namespaces": [], "veths": [], "rules": []}
    assert f"isthmus-{job}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # fmt: skip
    assert f"is-{job}-" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout  # fmt: skip
    for table in ("nat", "filter"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True)
        assert f"isthmus:{job}" not in rules.stdout


def test_teardown_removes_everything_and_stops_processes() -> None:
    job = job_name("b")
    with TransparentWan(job, 3, SPEC) as wan:
        sleeper = subprocess.Popen([*wan.sites[2].exec_prefix, "sleep", "60"])
        assert len(job_resources(job)["namespaces"]) == 3
    assert sleeper.wait(timeout=10) != 0
    nothing_left(job)
    assert teardown(job) == {"namespaces": [], "veths": [], "rules": []}  # idempotent


def test_teardown_after_an_exception() -> None:
    job = job_name("c")
    with pytest.raises(RuntimeError, match="boom"), TransparentWan(job, 2, SPEC):
        raise RuntimeError("boom")
    nothing_left(job)


def start_cli(job: str, *more: str) -> tuple[subprocess.Popen, list[str]]:
    cli = subprocess.Popen(
        [sys.executable, "-m", "isthmus.deploy.commands.netns", "up", "--sites", "2", "--job", job,
         "--control", "127.0.0.1:0", *more],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    while not (line := cli.stdout.readline()).startswith("Ctrl-C"):
        assert line, "netns up exited early"
        lines.append(line)
    return cli, lines


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_up_prints_sites_and_cleans_up_on_signal(sig: signal.Signals) -> None:
    job = job_name("d")
    cli, lines = start_cli(job)
    try:
        assert any(f"ip netns exec isthmus-{job}-site1" in line for line in lines), lines
        assert len(job_resources(job)["namespaces"]) == 2
        cli.send_signal(sig)
        assert cli.wait(timeout=30) == 0
    finally:
        if cli.poll() is None:
            cli.kill()
    nothing_left(job)


def test_cli_up_caps_each_flow_when_asked() -> None:
    job = job_name("h")
    cli, lines = start_cli(job, "--per-flow-mbit", "300")
    try:
        assert "300 Mbit/s per flow" in lines[0], lines
        control = next(line.split()[1] for line in lines if line.startswith("control"))
        spec = control_request(control, "GET", "/links")["site0-site1"]["spec"]
        assert spec["a_to_b"]["per_flow_mbit"] == spec["b_to_a"]["per_flow_mbit"] == 300
    finally:
        cli.send_signal(signal.SIGTERM)
        cli.wait(timeout=30)
    nothing_left(job)


def test_cli_down_cleans_up_after_a_crash() -> None:
    job = job_name("e")
    cli, _ = start_cli(job)
    cli.kill()  # SIGKILL: no teardown runs
    cli.wait()
    assert job_resources(job)["namespaces"]
    down = subprocess.run(
        [sys.executable, "-m", "isthmus.deploy.commands.netns", "down", "--job", job],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 0, down.stderr
    assert "removed 2 namespace(s)" in down.stdout
    nothing_left(job)


def _assert_1_gbit(bulk_s: Callable[[], float], first_s: float) -> None:
    """A 1 ms, 1 Gbit/s link's rate from 64 MiB probes (``first_s`` one already made):
    one probe at the end of a CI run once carried 885 Mbit/s while other jobs held the
    cores, so the best of a few meets the spec (tests/sim/measured.py), and none may
    pass it by more than 10 %."""
    times = [first_s]

    def rate() -> float:
        return (64 << 20) * 8 / ((times.pop() if times else bulk_s()) - 1e-3)

    assert_rate(rate, 1e9, 0.10, attempts=4, what="1 Gbit/s netns link")


@pytest.mark.timeout(120)
def test_cli_up_serves_control_and_a_1_ms_link() -> None:
    job = job_name("g")
    # `isthmus wan netns up` (netns_cmd's command, with its control endpoint). A 4 MiB
    # queue (32 ms at 1 Gbit/s) absorbs the sender's stalls when other jobs hold the
    # cores; with the default 256 KiB (2 ms) the link idled through some of them.
    cli = subprocess.Popen(
        [*WAN, "netns", "up", "--sites", "2", "--job", job, "--control", "127.0.0.1:0",
         "--distance-km", "102.04", "--bandwidth-mbit", "1000", "--queue-kib", "4096"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        lines: list[str] = []
        while not (line := cli.stdout.readline()).startswith("Ctrl-C"):
            assert line, "netns up exited early"
            lines.append(line)
        control = next(line.split()[1] for line in lines if line.startswith("control"))
        address = next(line.split()[1] for line in lines if line.split()[0] == "site1")
        serve = [*NICE, sys.executable, "-c", SERVER, "0.0.0.0", str(PORT)]
        in_site = {i: ["ip", "netns", "exec", f"isthmus-{job}-site{i}"] for i in (0, 1)}
        servers = [subprocess.Popen([*in_site[i], *serve], stdout=subprocess.PIPE, text=True)
                   for i in (0, 1)]  # fmt: skip
        try:
            assert all(s.stdout.readline().strip() == "ready" for s in servers)

            def probe(host: str, nbytes: int) -> dict:
                client = [sys.executable, "-c", CLIENT, host, str(PORT), str(nbytes)]
                done = subprocess.run(
                    [*in_site[0], *NICE, *client], capture_output=True, text=True, timeout=60
                )
                assert done.returncode == 0, done.stderr
                return json.loads(done.stdout)

            # The endpoints' own round trip (loopback inside site0, no link): what a real
            # link would cost them too, so not the emulator's error.
            own = probe("127.0.0.1", 0)
            got = probe(address, 64 << 20)
            _assert_1_gbit(lambda: probe(address, 64 << 20)["bulk_s"], got["bulk_s"])
        finally:
            for s in servers:
                s.kill()
                s.wait()
        # 102.04 km = 0.5 ms one way: the bound, max(5 %, 0.2 ms) of the RTT, on
        # what the link adds to the fastest round trip (the endpoints' wake-ups on a busy
        # 2-core CI box took it from 1.00 to 1.21 ms alone); the median only loosely,
        # since other jobs delay those wake-ups (1.31 ms seen beside another suite).
        added = got["rtt_min_s"] - own["rtt_min_s"]
        assert added == pytest.approx(1e-3, abs=0.2e-3), (got, own)
        assert got["rtt_s"] < 2e-3, got

        link = control_request(control, "GET", "/links")["site0-site1"]
        assert link["stats"]["a_to_b"]["bytes_delivered"] >= 64 << 20
        assert {entry["kind"] for entry in link["listeners"]} == {"transparent"}
        t0 = time.monotonic()
        changed = control_request(control, "POST", "/links/site0-site1", {"bandwidth_mbit": 50})
        assert time.monotonic() - t0 < 1.0  # the issue: `wan set` answers within a second
        assert changed["spec"]["b_to_a"]["bandwidth_mbit"] == 50
        shown = subprocess.run(
            [*WAN, "show", "--control", control], capture_output=True, text=True, timeout=30
        )
        assert "site0 -> site1" in shown.stdout and "50 Mbit/s" in shown.stdout, shown.stdout
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=30) == 0
    finally:
        if cli.poll() is None:  # a failed assertion: tear the job down all the same
            cli.send_signal(signal.SIGTERM)
            try:
                cli.wait(timeout=30)
            except subprocess.TimeoutExpired:
                cli.kill()
                cli.wait()
                subprocess.run([*WAN, "netns", "down", "--job", job], timeout=60, check=False)
    nothing_left(job)


def test_a_second_up_of_a_live_job_is_refused_and_keeps_it() -> None:
    job = job_name("f")
    with TransparentWan(job, 2, SPEC):
        with pytest.raises(Exception, match="exists"):
            TransparentWan(job, 2, SPEC).start()
        assert len(job_resources(job)["namespaces"]) == 2
    nothing_left(job)


@pytest.mark.slow
def test_side_by_side_quick_writes_both_timings(tmp_path: Path) -> None:
    out = tmp_path / "sbs.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "side_by_side.py"), "--quick"]
        + ["--job", job_name("h"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["flat_s"] > 0 and row["isthmus_s"] > 0
    assert row["ratio"] == pytest.approx(row["flat_s"] / row["isthmus_s"])
    # Both ways moved the tensors across the emulated link, not around it.
    assert result["link"]["a_to_b"]["bytes_delivered"] > 2 * 4 * (1 << 20)
    nothing_left(job_name("h"))


def test_a_site_of_two_nodes_reaches_the_others_only_through_its_link() -> None:
    job = job_name("n")
    with pytest.raises(ValueError, match="nodes must list"):
        TransparentWan(job, 2, SPEC, nodes=[2]).start()
    assert not any(job_resources(job).values())  # refused before anything was made
    with TransparentWan(job, 2, SPEC, nodes=[1, 2]) as wan:
        second = wan.sites[1].nodes[0]
        assert second.namespace == f"isthmus-{job}-site1-n1"
        serve = [sys.executable, "-c", SERVER, "0.0.0.0", str(PORT)]
        servers = [
            subprocess.Popen([*prefix, *serve], stdout=subprocess.PIPE, text=True)
            for prefix in (second.exec_prefix, wan.sites[0].exec_prefix)
        ]
        try:
            assert all(s.stdout.readline().strip() == "ready" for s in servers)
            assert in_site(wan, 1, PROBE, second.address, PORT) == "answered"  # the LAN
            assert wan.relayed == 0
            assert in_site(wan, 0, PROBE, second.address, PORT) == "answered"  # the link
            from_second = subprocess.run(
                [*second.exec_prefix, sys.executable, "-c", PROBE, wan.sites[0].address, str(PORT)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert from_second.stdout.strip() == "answered", from_second
            assert wan.relayed == 2 and wan.refused == 0
            stats = wan.links["site0-site1"].stats()
            assert stats["a_to_b"]["bytes_delivered"] >= 2 <= stats["b_to_a"]["bytes_delivered"]
        finally:
            for server in servers:
                server.kill()
                server.wait()
        assert len(job_resources(job)["namespaces"]) == 3
    nothing_left(job)
