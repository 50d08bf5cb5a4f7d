"""Refusals are logged by caller host, a bounded number of lines a window, with a
summary of what was not logged (issue 63, item 4).

The finding: a stranger's connection flood wrote one WARNING per connection (1.2 MB a
rank log in 80 s), because the bulk listener's refusals were keyed by ip:port and
their reason carried the exception's text. Here a real bulk listener and a real gRPC
server with the job's TLS and token are flooded over loopback, from many loopback
hosts, and the log stays at most ``lines`` lines a window however many refusals come;
the summary line accounts for every refusal that was not logged. Time is a
``ManualClock`` that the test moves: nothing waits for a window to pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from helpers import ManualClock, wait_until

from isthmus.inter.bounds import RefusalLog, peer_host
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.transport.bulk import ACCEPTED, BulkListener
from isthmus.inter.data.transport.bulk_stream import server_context
from isthmus.inter.security import SiteSecurity

pytestmark = pytest.mark.timeout(120)

SUMMARY = re.compile(r"(\d+) refusal\(s\) from (\d+) host\(s\) not logged .*most from (\S+): (\d+)")


def lines(caplog: pytest.LogCaptureFixture, where: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{where}:")]


def summaries(caplog: pytest.LogCaptureFixture, where: str) -> list[re.Match]:
    return [m for line in lines(caplog, where) if (m := SUMMARY.search(line))]


# -- the log alone -------------------------------------------------------------------


def test_one_host_flooding_one_kind_is_one_line_and_then_a_summary(caplog) -> None:
    """A flood from one host, each refusal on a new port and with its own numbers and
    exception text: one line, then one summary line that counts the rest."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    clock = ManualClock()
    refusals = RefusalLog("lane of site 0", clock=clock)
    for port in range(40_000, 40_500):
        refusals.note(f"ipv4:10.0.0.9:{port}", f"frame of {port} bytes refused", f"errno {port}")
    assert refusals.count == 500
    assert len(lines(caplog, "lane of site 0")) == 1
    assert "frame of 40000 bytes refused: errno 40000 from ipv4:10.0.0.9:40000" in caplog.text
    clock.advance(61)
    refusals.note("ipv4:10.0.0.9:1", "frame of 1 bytes refused")
    (summary,) = summaries(caplog, "lane of site 0")
    assert summary.groups() == ("499", "1", "10.0.0.9", "499")
    # The new window logs the kind again, with how many that host sent in all.
    assert lines(caplog, "lane of site 0")[-1].endswith("(501 from 10.0.0.9 so far)")


def test_many_hosts_get_at_most_lines_a_window_in_all(caplog) -> None:
    """Each host's first refusal is new, yet at most ``lines`` are logged a window;
    the summary names how many hosts the rest came from and which sent the most."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    clock = ManualClock()
    refusals = RefusalLog("coordinator of site0", lines=5, clock=clock)
    for host in range(100):
        refusals.note(f"ipv4:10.1.0.{host}:5000", "call refused (wrong job token)")
    for _ in range(7):
        refusals.note("ipv6:[fd00::1]:6000", "call refused (wrong job token)")
    assert len(lines(caplog, "coordinator of site0")) == 5
    refusals.flush()  # the window has not ended: nothing to say yet
    assert summaries(caplog, "coordinator of site0") == []
    clock.advance(60)
    refusals.flush()
    (summary,) = summaries(caplog, "coordinator of site0")
    assert summary.groups() == ("102", "96", "[fd00::1]", "7")
    assert refusals.count == 107
    refusals.flush()  # said once
    assert len(summaries(caplog, "coordinator of site0")) == 1


def test_a_window_ends_with_its_summary_though_no_refusal_comes_after(caplog) -> None:
    """The summary of the last window of a flood is written by the thread that all
    logs share, not left for a refusal that may never come (a real clock, a short
    window; the test waits for the line, however long a loaded machine takes)."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    refusals = RefusalLog("witness", window_s=0.2)
    for port in range(5):
        refusals.note(f"ipv4:10.2.0.1:{port}", "a vote without its key")
    wait_until(lambda: summaries(caplog, "witness"), "the summary was written", 30)
    assert summaries(caplog, "witness")[0].groups() == ("4", "1", "10.2.0.1", "4")


def test_a_caller_is_its_host_whatever_form_its_address_takes() -> None:
    assert peer_host("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "[::1]"
    assert peer_host("127.0.0.1:5555") == "127.0.0.1"
    assert peer_host("unix:/tmp/agent.sock") == "unix:/tmp/agent.sock"
    assert peer_host("the listener") == "the listener"
    with pytest.raises(ValueError, match="lines must be >= 1"):
        RefusalLog("x", lines=0)


# -- real servers, flooded over loopback ---------------------------------------------

HOSTS = [f"127.0.0.{i}" for i in range(2, 32)]  # Linux answers all of 127/8 on lo


def connect_from(host: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((host, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_flood_of_the_bulk_port_is_logged_boundedly(job_dir, caplog) -> None:
    """300 connections from 30 hosts to a bulk listener under mutual TLS: plaintext
    garbage (no TLS at all) and TLS hellos without a ticket. Before: a line each (the
    key was ip:port and the reason held the SSL error's text). After: at most
    ``lines``, and the summary accounts for every refusal not logged."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    clock = ManualClock()
    where = "lane of site 0 (flooded)"
    refusals = RefusalLog(where, clock=clock)
    security = SiteSecurity.load(job_dir, "site0", require_tls=True)
    listener = BulkListener(
        "127.0.0.1",
        lambda *_: (ACCEPTED, None, ""),
        1 << 20,
        where,
        refusals=refusals,
        tls=server_context(security),
        vouch=lambda holder, names: holder in names,
    )
    try:
        for round_ in range(10):
            for host in HOSTS:
                with connect_from(host, listener.port) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(32 + round_))
                    with contextlib.suppress(OSError):
                        while sock.recv(4096):  # until the listener closes it
                            pass
        wait_until(lambda: refusals.count >= 300, "every connection refused", 60)
        logged = lines(caplog, where)
        assert len(logged) <= refusals.lines, "\n".join(logged)
        assert all("TLS handshake failed" in line for line in logged), logged
        clock.advance(refusals.window_s)
        refusals.flush()
        (summary,) = summaries(caplog, where)
        unlogged, hosts = int(summary[1]), int(summary[2])
        assert len(logged) + unlogged == refusals.count
        assert hosts == len(HOSTS)
    finally:
        listener.stop()


def test_a_lane_as_it_ships_logs_a_bulk_flood_boundedly(job_dir, caplog) -> None:
    """The same flood at a LaneServer as a rank starts it (its own RefusalLog, the real
    clock): 150 refused connections, at most ``lines`` lines a window (before: 150)."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    security = SiteSecurity.load(job_dir, "site0", require_tls=True, require_token=True)
    lane = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1, security=security)
    try:
        for _ in range(5):
            for host in HOSTS:
                with connect_from(host, lane.bulk_port) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    with contextlib.suppress(OSError):
                        while sock.recv(4096):
                            pass
        wait_until(lambda: lane.refusals.count >= 150, "every connection refused", 60)
        logged = lines(caplog, lane.where)
        windows = 1 + len(summaries(caplog, lane.where))  # a loaded run may span two
        assert len(logged) <= windows * lane.refusals.lines + windows - 1, "\n".join(logged)
    finally:
        lane.stop(0)


def test_a_flood_of_calls_with_a_wrong_token_is_logged_boundedly(job_dir, caplog) -> None:
    """200 connections to a gRPC server with the job's TLS and token, each presenting
    a valid certificate and a wrong token (or none): one line per kind, by the same
    RefusalLog the server's other refusals use, then the summary."""
    caplog.set_level(logging.WARNING, logger="isthmus.bounds")
    clock = ManualClock()
    where = "coordinator of site0 (flooded)"
    refusals = RefusalLog(where, clock=clock)
    security = SiteSecurity.load(job_dir, "site0", require_tls=True, require_token=True)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=security.server_interceptors(where, refusals),
    )
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Call": echo}),)
    )
    port = security.add_port(server, "127.0.0.1:0")
    server.start()
    site1 = SiteSecurity.load(job_dir, "site1", require_tls=True)
    wrong = SiteSecurity(
        require_tls=True, ca=site1.ca, cert=site1.cert, key=site1.key, token="w" * 32
    )
    try:
        for caller in [wrong, site1] * 100:
            # A channel of its own each time: a new connection, a new client port.
            with caller.channel(f"127.0.0.1:{port}", [("grpc.use_local_subchannel_pool", 1)]) as ch:
                with pytest.raises(grpc.RpcError) as refused:
                    ch.unary_unary("/test.Echo/Call")(b"x", timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refusals.count == 200
        logged = lines(caplog, where)
        assert len(logged) == 2, logged  # one per kind: no token, a wrong token
        assert all("/test.Echo/Call from ipv4:127.0.0.1:" in line for line in logged), logged
        clock.advance(refusals.window_s)
        refusals.flush()
        (summary,) = summaries(caplog, where)
        assert summary.groups() == ("198", "1", "127.0.0.1", "198")
    finally:
        server.stop(0)


CHILD = """
import sys
if sys.argv[1] == "cli":
    import isthmus.deploy.cli  # noqa: F401  (sets GRPC_VERBOSITY before grpc loads)
from concurrent import futures
import grpc
from isthmus.inter.security import SiteSecurity
security = SiteSecurity.load(sys.argv[2], "site0", require_tls=True, require_token=True)
server = grpc.server(futures.ThreadPoolExecutor(2))
print(security.add_port(server, "127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(0)
"""


def handshake_lines_on_stderr(entry: str, certs: str, connections: int) -> int:
    """Starts a TLS gRPC server in a process (imported as ``entry`` says), sends it
    ``connections`` plaintext connections, and counts gRPC's handshake lines on its
    stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, entry, certs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        for _ in range(connections):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                with contextlib.suppress(OSError):
                    while sock.recv(4096):  # the handshake failed: closed
                        pass
        _, stderr = child.communicate("", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return sum("Handshake failed" in line for line in stderr.splitlines())


def test_the_cli_keeps_grpcs_per_connection_handshake_lines_off_stderr(job_dir) -> None:
    """gRPC's C core writes a line to stderr for each connection that fails the TLS
    handshake (grpcio 1.85, at its default verbosity): a flood writes a line a
    connection that no Python logging bounds. Every isthmus process starts from the
    CLI, which sets GRPC_VERBOSITY=NONE (deploy/cli.py says why; ranks inherit it), so
    a flood of such a process writes none. Kubernetes' GRPC_VERBOSITY=ERROR keeps them
    off too: the line is at INFO."""
    assert handshake_lines_on_stderr("bare", str(job_dir), 20) >= 1  # what the CLI spares
    assert handshake_lines_on_stderr("cli", str(job_dir), 20) == 0
