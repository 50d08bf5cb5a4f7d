"""The WAN relay over real loopback sockets: latency, bandwidth, backpressure, CONNECT."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from concurrent import futures

import grpc
import pytest
from helpers import wait_until
from measured import assert_delay, assert_rate
from sockets import Server, connect, noting_echo_link, send_timed, serve_echo, sink_server

from isthmus.sim import DirectionSpec, LinkSpec, RelayServer, proxy_channel_options

MBIT = 1e6


@pytest.mark.timeout(60)
def test_ping_pong_rtt(either_relay) -> None:
    relay = either_relay
    spec = LinkSpec.symmetric(latency_s=0.010, bandwidth_bps=200 * MBIT)
    echo = Server(serve_echo)
    try:
        address = relay.add_link("ab", spec).add_forward(*echo.address)
        with connect(address) as s:

            def median_rtt() -> float:
                rtts = []
                for i in range(25):
                    t0 = time.monotonic()
                    s.sendall(b"ping")
                    assert s.recv(16) == b"ping"
                    if i >= 5:  # warm-up: connection to the target, first scheduling
                        rtts.append(time.monotonic() - t0)
                assert min(rtts) >= spec.rtt_s * 0.99  # never faster than light, any attempt
                return statistics.median(rtts)

            # 10%, a loose bound here (tests/sim/test_wan_fidelity.py holds the issue's
            # tighter one), on the best of a few attempts: the fresh-clone suite once read
            # a median of 24.3 ms for 20 ms on the 2-core machine while other work held
            # its cores, and load only ever lengthens a round trip (tests/sim/measured.py).
            assert_delay(median_rtt, spec.rtt_s, 0.10 * spec.rtt_s, what="median RTT")
    finally:
        echo.close()


@pytest.mark.timeout(60)
def test_throughput_matches_bandwidth(relay) -> None:
    spec = LinkSpec.symmetric(latency_s=0.010, bandwidth_bps=200 * MBIT)
    with sink_server() as (sink, server):
        link = relay.add_link("ab", spec)
        with connect(link.add_forward(*server.address)) as s:
            # Never above 200 Mbit/s + 10 %, and within 10 % on one of a few attempts
            # (tests/sim/measured.py: a starved machine only ever slows a link down).
            rates = assert_rate(
                lambda: send_timed(s, sink, 24 << 20, spec.a_to_b.latency_s), 200 * MBIT, 0.10
            )
        # The pump counts a piece after its write returns, so the sink may hold the last
        # piece a moment before the counter does (CI once read 1,017 bytes short).
        sent = len(rates) * (24 << 20)
        wait_until(lambda: link.stats()["a_to_b"]["bytes_delivered"] >= sent, "delivered count")
        assert link.stats()["a_to_b"]["bytes_delivered"] == sent
        assert link.stats()["a_to_b"]["connections"] == 1


@pytest.mark.timeout(60)
def test_bandwidth_shared_by_connections(relay) -> None:
    spec = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=100 * MBIT)
    with sink_server() as (sink, server):
        address = relay.add_link("ab", spec).add_forward(*server.address)

        def two_connections() -> float:
            socks = [connect(address) for _ in range(2)]
            start = sink.received
            t0 = time.monotonic()
            for s in socks:
                threading.Thread(target=s.sendall, args=(b"x" * (6 << 20),), daemon=True).start()
            t1 = sink.wait_for(start + (12 << 20))
            for s in socks:
                s.close()
            return (12 << 20) * 8 / (t1 - t0 - 0.005)

        # Two connections share one direction's 100 Mbit/s rather than getting it each
        # (never above it + 10 %; within 10 % on one of a few attempts: measured.py).
        assert_rate(two_connections, 100 * MBIT, 0.10)


@pytest.mark.timeout(60)
def test_stalled_receiver_bounds_bytes_in_flight(either_relay) -> None:
    relay = either_relay
    spec = LinkSpec.symmetric(latency_s=0.010, bandwidth_bps=50 * MBIT, queue_bytes=64 << 10)
    stalled = threading.Event()

    def never_read(conn: socket.socket) -> None:
        with conn:
            stalled.wait()

    server = Server(never_read, rcvbuf=64 << 10)
    try:
        link = relay.add_link("ab", spec)
        s = connect(link.add_forward(*server.address))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.setblocking(False)
        chunk, accepted, goal = b"x" * 65536, 0, 32 << 20
        last_progress = time.monotonic()
        while accepted < goal and time.monotonic() - last_progress < 1.0:
            try:
                accepted += s.send(chunk)
                last_progress = time.monotonic()
            except BlockingIOError:
                time.sleep(0.01)
        # What may hold bytes, largest first, in KiB: the relay's own window beyond the
        # link (256, its pipes), kernel buffers that Linux doubles (sender SO_SNDBUF
        # 128, relay in 256, relay out 256, sink 128) and the link itself (50 Mbit/s *
        # 10 ms = 61 + queue 64): ~1.2 MiB; 4 MiB leaves slack for loopback
        # accounting, far below the 32 MiB the sender tries.
        assert accepted < 4 << 20, accepted
        assert link.stats()["a_to_b"]["inflight_bytes"] <= spec.a_to_b.inflight_limit_bytes
        s.close()
    finally:
        stalled.set()
        server.close()


@pytest.mark.timeout(60)
def test_live_bandwidth_update(relay) -> None:
    slow = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=40 * MBIT)
    fast = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=160 * MBIT)
    with sink_server() as (sink, server):
        link = relay.add_link("ab", slow)
        with connect(link.add_forward(*server.address)) as s:
            # Each rate within 10 % (never above it; reached on one of a few attempts:
            # measured.py), on the same live connection through the same listener.
            assert_rate(lambda: send_timed(s, sink, 4 << 20, 0.005), 40 * MBIT, 0.10)
            link.update(fast)
            assert_rate(lambda: send_timed(s, sink, 16 << 20, 0.005), 160 * MBIT, 0.10)
        assert link.spec == fast


@pytest.mark.timeout(60)
def test_half_close_delivers_data_then_eof(either_relay) -> None:
    relay = either_relay
    echo = Server(serve_echo)
    try:
        link = relay.add_link("ab", LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=50 * MBIT))
        with connect(link.add_forward(*echo.address)) as s:
            payload = bytes(range(256)) * 4096  # 1 MiB, more than the link holds at once
            threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload) // 2:
                got += s.recv(65536)
            s.shutdown(socket.SHUT_WR)  # EOF travels after the data; echo then closes
            while data := s.recv(65536):
                got += data
        assert bytes(got) == payload
    finally:
        echo.close()


@pytest.mark.timeout(60)
def test_target_reset_closes_client(either_relay) -> None:
    relay = either_relay

    def reset(conn: socket.socket) -> None:
        conn.recv(16)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        conn.close()  # linger 0: RST

    server = Server(reset)
    try:
        link = relay.add_link("ab", LinkSpec.symmetric(latency_s=0.002))
        with connect(link.add_forward(*server.address)) as s:
            s.sendall(b"hello")
            assert _recv_or_reset(s) == b""  # the relay closed our side too
    finally:
        server.close()


def _recv_or_reset(sock: socket.socket) -> bytes:
    # A reset or an orderly close both mean "the relay closed this side".
    try:
        return sock.recv(16)
    except ConnectionResetError:
        return b""


def _proxy_request(address, request: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(request)
        answer = b""
        while data := s.recv(4096):
            answer += data
        return answer


@pytest.mark.timeout(60)
def test_connect_proxy_refuses_non_loopback(either_relay) -> None:
    relay = either_relay
    link = relay.add_link("ab", LinkSpec.symmetric(latency_s=0.005))
    address = link.add_proxy()
    for target in (b"192.0.2.1:443", b"example.com:80", b"[2001:db8::1]:80"):
        answer = _proxy_request(address, b"CONNECT " + target + b" HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert _proxy_request(address, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _proxy_request(address, b"CONNECT nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert link.targets_connected == 0  # refused before any connection attempt
    assert link.proxy_refused == 5
    with pytest.raises(ValueError, match="loopback"):
        link.add_forward("192.0.2.1", 80)


@pytest.mark.timeout(60)
def test_grpc_through_connect_proxy(either_relay, monkeypatch) -> None:
    relay = either_relay
    # no_proxy / no_grpc_proxy would silently bypass even the channel option (see relay.py).
    for name in ("no_proxy", "NO_PROXY", "no_grpc_proxy", "NO_GRPC_PROXY"):
        monkeypatch.delenv(name, raising=False)
    spec = LinkSpec.symmetric(latency_s=0.010, bandwidth_bps=100 * MBIT)
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        link = relay.add_link("ab", spec)
        options = proxy_channel_options(link.add_proxy())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            echo = channel.unary_unary("/test.Echo/Echo")
            t0 = time.monotonic()
            assert echo(b"hi", timeout=10) == b"hi"
            first = time.monotonic() - t0
            t0 = time.monotonic()
            assert echo(b"again", timeout=10) == b"again"
            second = time.monotonic() - t0
        # The first call pays CONNECT, the HTTP/2 preface and the call: >= 2 RTTs.
        assert first >= 2 * spec.rtt_s
        assert second >= spec.rtt_s
        assert link.targets_connected == 1
        assert link.stats()["a_to_b"]["connections"] == 1
    finally:
        server.stop(None)


@pytest.mark.timeout(60)
def test_close_releases_ports_and_is_idempotent() -> None:
    echo = Server(serve_echo)
    try:
        relay = RelayServer()
        link = relay.add_link("ab", LinkSpec.symmetric(latency_s=0.001))
        forward, proxy = link.add_forward(*echo.address), link.add_proxy()
        held = connect(forward)  # a live connection at close() time
        held.sendall(b"x")
        assert held.recv(1) == b"x"
        relay.close()
        relay.close()
        assert _recv_or_reset(held) == b""
        held.close()
        for address in (forward, proxy):
            with socket.socket() as s:
                # SO_REUSEADDR as servers set it: it tolerates the TIME_WAIT left by the
                # connection the relay closed, but never a listener still bound.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
        with pytest.raises(RuntimeError):
            link.add_proxy()
        with pytest.raises(RuntimeError):
            relay.add_link("cd", LinkSpec.symmetric(latency_s=0.001))
    finally:
        echo.close()


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        DirectionSpec(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        DirectionSpec(latency_s=0, bandwidth_bps=float("nan"))
    with pytest.raises(ValueError, match="queue_bytes"):
        DirectionSpec(latency_s=0, queue_bytes=1.5)
    with pytest.raises(ValueError, match="km"):
        LinkSpec.from_distance(-3, 1e9)
    spec = LinkSpec.from_distance(1000, 1e9)
    assert spec.rtt_s == pytest.approx(2 * 1000 * 4.9e-6)
    # 10 ms of 1 MB/s, and the queue: never under 2 ms of the rate (MIN_QUEUE_S) ...
    shallow = DirectionSpec(latency_s=0.01, bandwidth_bps=8e6, queue_bytes=0)
    assert shallow.queue_limit_bytes == 2_000
    assert shallow.inflight_limit_bytes == 10_000 + 2_000
    # ... a deeper one as asked, and an unlimited direction's as asked too
    deep = DirectionSpec(latency_s=0.01, bandwidth_bps=8e6, queue_bytes=5_000)
    assert deep.inflight_limit_bytes == 10_000 + 5_000
    assert DirectionSpec(latency_s=0.01, queue_bytes=0).queue_limit_bytes == 0


@pytest.mark.timeout(30)
def test_link_reset_resets_both_sides_of_every_connection(either_relay) -> None:
    relay = either_relay
    """`Link.reset()` (the chaos suite's partition: open connections notice at once):
    the client and the server both get RST, and the link carries new connections."""
    with noting_echo_link(relay, 0.002) as (link, address, server_saw):
        with connect(address) as s:
            s.sendall(b"hi")
            assert s.recv(16) == b"hi"
            link.reset()
            with pytest.raises(ConnectionResetError):
                s.recv(16)
        deadline = time.monotonic() + 5
        while not server_saw and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server_saw == ["reset"]
        with connect(address) as s:
            s.sendall(b"again")
            assert s.recv(16) == b"again"
