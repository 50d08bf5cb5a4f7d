"""The bulk port inside mutual TLS (inter/data/transport/bulk_stream.py) against real lanes.

What a round moves (exact sums, and no payload byte in the clear on the wire), and who
gets nothing: a plaintext client, a certificate of another CA, a job certificate that
does not name the site its ticket was granted to. Each refusal leaves the mailbox empty.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading

import grpc
import pytest
import torch
from helpers import raw_chunk, wait_until
from lanes import lane_pair, run_all
from sockets import Server

from isthmus.deploy.commands.certs import write_certs
from isthmus.inter.data.codecs.chain import crc32
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.transport import wirecore
from isthmus.inter.data.transport.bulk import ACCEPTED, MAGIC, OK, REFUSED, frame_bytes
from isthmus.inter.data.transport.bulk_stream import TlsStream, client_context, server_context
from isthmus.inter.data.transport.wirecore import FrameClosed
from isthmus.inter.security import SiteSecurity

pytestmark = pytest.mark.timeout(90)

SITES = ("site0", "site1", "site2")
PATTERN = bytes(range(7, 71))  # 64 bytes no TLS record would carry by chance


@pytest.fixture(scope="module")
def three_site_certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bulk-tls-certs")
    write_certs(out, list(SITES))
    return out


def security(folder, site: str) -> SiteSecurity:
    return SiteSecurity.load(folder, site, require_tls=True)


@pytest.fixture()
def lane(three_site_certs):
    """Site 0's lane of a three-site job, under mutual TLS, its sites named."""
    server = LaneServer(
        site_index=0,
        num_sites=3,
        codec="raw",
        generation=1,
        security=security(three_site_certs, "site0"),
    )
    server.set_members(Members(1, 0, 3, site_names=SITES))
    yield server
    server.stop(0)


def dial(lane: LaneServer, context: ssl.SSLContext) -> TlsStream:
    sock = socket.create_connection(("127.0.0.1", lane.bulk_port), timeout=5)
    return TlsStream.handshake(TlsStream.wrap(sock, context, server_side=False), 5)


def reply(stream: TlsStream) -> tuple[int, int | None, str]:
    status = bytearray(1)
    stream.read_exact(memoryview(status), 5)
    if status[0] != REFUSED:
        return status[0], None, ""
    head = bytearray(3)
    stream.read_exact(memoryview(head), 5)
    code, size = struct.unpack("<BH", head)
    reason = bytearray(size)
    stream.read_exact(memoryview(reason), 5)
    return status[0], code, reason.decode()


def test_a_ticket_on_a_certificate_that_names_its_site_admits_chunks_and_no_other(
    lane, three_site_certs
) -> None:
    """A ticket granted to site2, presented inside TLS by site2's certificate, admits a
    chunk in site2's name; the same kind of ticket presented by site1's certificate (a
    site of the job, but not the ticket's) is refused before any chunk is read."""
    stream = dial(lane, client_context(security(three_site_certs, "site1")))
    try:
        stream.send(MAGIC + lane.tickets.issue("site2"))
        status, code, why = reply(stream)
        assert (status, code) == (REFUSED, grpc.StatusCode.PERMISSION_DENIED.value[0])
        assert "does not name it" in why
    finally:
        stream.close()
    assert len(lane.mailbox) == 0

    stream = dial(lane, client_context(security(three_site_certs, "site2")))
    try:
        stream.send(MAGIC + lane.tickets.issue("site2"))
        assert reply(stream)[0] == OK
        stream.send_parts([frame_bytes(raw_chunk(from_site=2).SerializeToString()), b""])
        assert reply(stream)[0] == ACCEPTED
    finally:
        stream.close()
    assert len(lane.mailbox) == 1


def test_a_plaintext_client_with_a_live_ticket_gets_nothing(lane, caplog) -> None:
    """The connection's first bytes must be a TLS handshake: a plaintext hello, even
    with a ticket the lane granted, is never answered OK and nothing is stored; the
    refusal is logged with the peer's address."""
    caplog.set_level(logging.INFO)
    answer = b""
    # The listener drops the connection at the first byte that is no handshake.
    with (
        socket.create_connection(("127.0.0.1", lane.bulk_port), timeout=5) as sock,
        contextlib.suppress(ConnectionResetError, BrokenPipeError),
    ):
        sock.sendall(MAGIC + lane.tickets.issue("site1"))
        sock.sendall(frame_bytes(raw_chunk(from_site=1).SerializeToString()))
        while chunk := sock.recv(4096):
            answer += chunk
    assert bytes([OK]) not in answer[:1]
    assert len(lane.mailbox) == 0
    # Logged by the listener's thread, which may close the socket before it logs.
    wait_until(lambda: "TLS handshake failed" in caplog.text, "the refusal logged", 10)


def test_a_certificate_of_another_ca_is_refused_both_ways(lane, tmp_path) -> None:
    """A site of another job (its own CA): the listener's certificate fails the client's
    check, and the client's would fail the listener's; no chunk is read."""
    write_certs(tmp_path, ["site1"])
    with pytest.raises(ssl.SSLError):
        dial(lane, client_context(security(tmp_path, "site1")))
    assert len(lane.mailbox) == 0


class _RecordingProxy:
    """An HTTP CONNECT proxy on loopback that keeps every byte clients sent through it."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self._lock = threading.Lock()
        self._server = Server(self._tunnel)
        self.url = f"http://127.0.0.1:{self._server.address[1]}"

    def _tunnel(self, client: socket.socket) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += client.recv(1024)
        host, port = request.split()[1].decode().rsplit(":", 1)
        far = socket.create_connection((host, int(port)))
        client.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        threading.Thread(target=self._pump, args=(far, client, False), daemon=True).start()
        self._pump(client, far, True)

    def _pump(self, src: socket.socket, dst: socket.socket, keep: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if keep:
                    with self._lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_a_round_on_the_bulk_port_inside_tls_is_exact_and_nothing_crosses_in_the_clear(
    job_dir, monkeypatch, tls: bool
) -> None:
    """Two sites sum a tensor whose bytes repeat a known pattern, through a proxy that
    keeps what it carried. Under TLS the sum is exact at both sites and the pattern is
    nowhere on the wire; without TLS (the control: the proxy does see payloads) it is."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")
    proxy = _RecordingProxy()
    secure = [security(job_dir, f"site{i}") if tls else None for i in range(2)]
    try:
        with lane_pair(
            timeout_s=30,
            connections=2,
            chunk_bytes=1 << 16,
            security=secure.__getitem__,
            proxy=lambda site: proxy.url,
        ) as ars:
            assert all(p.transport == "bulk" for a in ars for p in a.membership.peers().values())
            pattern = torch.frombuffer(bytearray(PATTERN * 4096), dtype=torch.float32)
            data = [[pattern.clone()], [torch.zeros_like(pattern)]]
            want = pattern.clone()
            res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
            assert not any(isinstance(r, BaseException) for r in res), res
            assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        with proxy._lock:
            wire = bytes(proxy.sent)
        assert len(wire) > pattern.numel() * 4  # the payload went through the proxy
        assert (PATTERN in wire) is not tls
    finally:
        proxy.close()


def _stream_pair(folder) -> tuple[TlsStream, TlsStream]:
    """A listener-side and a client-side TLS stream of one loopback connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    out: dict[str, TlsStream] = {}

    def accept() -> None:
        conn, _ = listener.accept()
        tls = TlsStream.wrap(conn, server_context(security(folder, "site0")), server_side=True)
        out["server"] = TlsStream.handshake(tls, 5)

    thread = threading.Thread(target=accept)
    thread.start()
    sock = socket.create_connection(listener.getsockname(), timeout=5)
    client = TlsStream.handshake(
        TlsStream.wrap(sock, client_context(security(folder, "site1")), server_side=False), 5
    )
    thread.join(5)
    listener.close()
    return out["server"], client


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_payload_read_inside_tls_is_checksummed_and_checked_for_nan(
    three_site_certs, monkeypatch, native: bool
) -> None:
    """The listener reads a payload through TLS, then checksums it and checks its fp32
    words (in C where wirecore's extension is built, else in numpy): both give the
    payload's CRC-32C, whether every fp32 word is finite, and FrameClosed when the peer
    closes mid-payload."""
    if native:
        assert wirecore.load() is not None, "wirecore's C extension is not built"
    else:
        monkeypatch.setattr(wirecore, "load", lambda: None)
    server, client = _stream_pair(three_site_certs)
    try:
        values = torch.randn(1 << 20)  # 4 MiB: 256 TLS records
        for bad in (False, True):
            if bad:
                values[123_457] = float("nan")
            payload = values.numpy().tobytes()
            sender = threading.Thread(target=client.send_parts, args=([b"", payload],))
            sender.start()
            buf = memoryview(bytearray(len(payload)))
            crc, finite = server.recv_payload(buf, 5, f32=True)
            sender.join(5)
            assert bytes(buf) == payload
            assert crc == crc32(payload) and finite is (not bad)
        client.send_parts([b"", b"\x01" * 1000])
        client.close()
        with pytest.raises(FrameClosed):
            server.recv_payload(memoryview(bytearray(4096)), 5, f32=False)
    finally:
        server.close()
        client.close()


def test_a_tls_payload_that_stalls_times_out_and_a_close_wakes_its_reader(
    three_site_certs,
) -> None:
    """The listener holds the connection's lock for a whole payload: a peer that stops
    mid-payload still ends the read after ``stall_s`` (TimeoutError), and closing the
    connection from another thread wakes a read that waits (OSError)."""
    server, client = _stream_pair(three_site_certs)
    try:
        client.send_parts([b"", b"\x02" * 1000])
        with pytest.raises(TimeoutError):
            server.recv_payload(memoryview(bytearray(4096)), 0.3, f32=False)
        threading.Timer(0.3, server.close).start()
        with pytest.raises(OSError):
            server.recv_payload(memoryview(bytearray(4096)), 30, f32=False)
    finally:
        server.close()
        client.close()
