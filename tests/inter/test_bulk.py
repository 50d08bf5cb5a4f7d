"""The bulk transport (inter/data/transport/bulk.py) against real lanes on loopback.

Who may connect (a ticket granted to a site's own lane, used once), what a
hostile or broken connection gets (a refusal with a reason, the connection closed, the
mailbox untouched), and that rounds recover from a broken connection by dialling again.
"""

from __future__ import annotations

import select
import socket
import struct

import grpc
import pytest
import torch
from helpers import raw_chunk, wait_until
from lanes import inputs, lane_pair, run_all

from isthmus.inter.data.codecs.chain import crc32, make_codec
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.allreduce import CrossSiteAllReduce, FixedMembership
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.transport.bulk import (
    ACCEPTED,
    MAGIC,
    OK,
    REFUSED,
    RESEND,
    frame_bytes,
    record_head,
)
from isthmus.inter.security import SiteSecurity
from isthmus.proto import lane_pb2, lane_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def ticket(server: LaneServer, site: int = 1) -> tuple[int, bytes]:
    """A ticket as the lane grants it to site ``site``'s own lane (``GrantBulk``); how
    it gets there is tests/inter/test_sender_bound_chunks.py's matter."""
    return server.bulk_port, server.tickets.issue(str(site))


def connect(port: int, hello: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(hello)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, int | None, str]:
    """(status, code, reason) of one reply; a refusal carries code and reason."""
    status = sock.recv(1)[0]
    if status != REFUSED:
        return status, None, ""
    head = b""
    while len(head) < 3:
        head += sock.recv(3 - len(head))
    code, size = struct.unpack("<BH", head)
    reason = b""
    while len(reason) < size:
        reason += sock.recv(size - len(reason))
    return status, code, reason.decode()


def frame(msg: bytes) -> bytes:
    return frame_bytes(msg)


def oversized_head() -> bytes:
    """A sound record head that announces a 1 GiB payload."""
    first = struct.pack("<III", 16, 1 << 30, 0)
    return first + struct.pack("<I", crc32(first))


def torn_head() -> bytes:
    """A record head with one bit of its length flipped: its own checksum fails."""
    head = bytearray(frame(raw_chunk().SerializeToString()))
    head[0] ^= 0x01
    return bytes(head)


def malformed_header() -> bytes:
    """A sound record head before a header that is no protobuf message."""
    junk = b"\x5a\xff\xff\xff\xff\x0f"
    return record_head(junk, 0) + junk


def closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def test_a_ticket_admits_one_connection_that_takes_chunks(lane) -> None:
    port, tk = ticket(lane)
    with connect(port, MAGIC + tk) as sock:
        assert read_reply(sock)[0] == OK
        sock.sendall(frame(raw_chunk().SerializeToString()))
        assert read_reply(sock)[0] == ACCEPTED
    assert len(lane.mailbox) == 1
    with connect(port, MAGIC + tk) as again:  # single use
        status, code, why = read_reply(again)
        assert (status, code) == (REFUSED, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert "no valid bulk ticket" in why and closed(again)


@pytest.mark.parametrize(
    "hello", [MAGIC + bytes(32), b"GET / HTTP/1.1\r\n" + bytes(24)], ids=["forged", "junk"]
)
def test_a_connection_without_a_ticket_is_refused(lane, hello) -> None:
    port, _ = ticket(lane)
    with connect(port, hello) as sock:
        status, code, _ = read_reply(sock)
        assert (status, code) == (REFUSED, grpc.StatusCode.UNAUTHENTICATED.value[0])
        assert closed(sock)
    assert len(lane.mailbox) == 0


@pytest.mark.parametrize(
    "payload, code, words",
    [
        (malformed_header(), grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
        (torn_head(), grpc.StatusCode.DATA_LOSS, "record head failed"),
        (oversized_head(), grpc.StatusCode.INVALID_ARGUMENT, "exceeds"),
        (
            frame(raw_chunk(generation=0).SerializeToString()),
            grpc.StatusCode.FAILED_PRECONDITION,
            "generation 0 != receiver's 1",
        ),
    ],
    ids=["malformed", "torn-head", "oversized", "wrong-generation"],
)
def test_a_bad_frame_is_refused_with_its_reason_and_changes_nothing(
    lane, payload, code, words
) -> None:
    port, tk = ticket(lane)
    with connect(port, MAGIC + tk) as sock:
        assert read_reply(sock)[0] == OK
        sock.sendall(payload)
        status, got, why = read_reply(sock)
        assert (status, got) == (REFUSED, code.value[0]) and words in why, why
        assert closed(sock)
    assert len(lane.mailbox) == 0


def test_a_damaged_frame_is_sent_again_and_only_the_intact_copy_is_taken(lane) -> None:
    msg = raw_chunk().SerializeToString()
    damaged = bytearray(frame(msg))
    damaged[16 + 1] ^= 0x04  # a header field: the payload's own checksum would not see it
    port, tk = ticket(lane)
    with connect(port, MAGIC + tk) as sock:
        assert read_reply(sock)[0] == OK
        sock.sendall(bytes(damaged))
        assert read_reply(sock)[0] == RESEND
        assert len(lane.mailbox) == 0 and lane.bulk.corrupt_frames == 1
        sock.sendall(frame(msg))
        assert read_reply(sock)[0] == ACCEPTED
    assert lane.mailbox.keys() == [(0, 0, 1, 0, 1)]


def test_open_bulk_needs_the_token(job_dir) -> None:
    token_only = SiteSecurity.load(job_dir, "site0", require_token=True)
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1, security=token_only)
    try:
        ask = lane_pb2.OpenBulkRequest(from_site=1, nonce=bytes(32))
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
            lane_pb2_grpc.LaneStub(channel).OpenBulk(ask, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A token holder asking in site 1's name gets no ticket either: it would go to
        # site 1's lane, and this lane has no round with site 1 to know where that is.
        with token_only.channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
            lane_pb2_grpc.LaneStub(channel).OpenBulk(ask, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_with_tls_chunks_go_on_the_bulk_port_inside_tls_unless_there_is_none(job_dir) -> None:
    """Under mutual TLS a peer sends on the bulk port (inside TLS: test_bulk_tls.py); a
    lane started without one refuses a ticket by name, since PushChunks calls need none
    (their certificate vouches for them)."""
    tls = SiteSecurity.load(job_dir, "site0", require_tls=True, require_token=True)
    server = LaneServer(
        site_index=0, num_sites=2, codec="raw", generation=1, security=tls, bulk=False
    )
    peer_security = SiteSecurity.load(job_dir, "site1", require_tls=True, require_token=True)
    peer = LanePeer(server.address, security=peer_security)
    try:
        assert peer.transport == "bulk"
        assert server.bulk_port == 0
        with peer_security.channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
            lane_pb2_grpc.LaneStub(channel).OpenBulk(lane_pb2.OpenBulkRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "mutual TLS is on and it has no bulk port" in info.value.details()
    finally:
        peer.close()
        server.stop(0)


def test_rounds_go_on_after_the_peer_drops_the_connection() -> None:
    with lane_pair(2, "raw", transport="bulk") as ars:
        for step in range(3):
            data = inputs(2, [5000], seed=step)
            want = data[0][0] + data[1][0]
            res = run_all(
                [
                    lambda s=s, d=data, st=step: ars[s].allreduce(d[s], st, 0, False)
                    for s in range(2)
                ]
            )
            assert not any(isinstance(r, BaseException) for r in res), res
            assert all(torch.equal(data[s][0], want) for s in range(2))
            # The receiving side drops every bulk connection between steps: the next
            # round dials again with a fresh ticket.
            for a in ars:
                a.server.bulk.drop_connections()


def test_chunks_that_came_before_the_rank_took_its_place_survive_it():
    """A peer that learned the membership first sends its first chunk while this rank
    is still setting up: the rank taking its place in the same generation keeps the
    chunk (it was dropped, and the round waited out the sync timeout); a new
    generation drops it."""
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1)
    try:
        status, _, why = server.take(raw_chunk(from_site=1))
        assert status == ACCEPTED, why
        server.set_members(Members(1, 0, 1, ("site0",)))  # a placeholder, as at start-up
        server.set_members(Members(1, 0, 2, ("site0", "site1")))
        assert len(server.mailbox) == 1
        server.set_members(Members(2, 0, 2, ("site0", "site1")))
        assert len(server.mailbox) == 0
    finally:
        server.stop(0)


@pytest.mark.timeout(60)
def test_a_flood_of_connections_without_tickets_stays_bounded_and_rounds_go_on() -> None:
    """Issue 33, row 5: 600 connections before any ticket took 516 threads of a rank.
    Past MAX_UNTICKETED waiting for a ticket, each new connection closes the oldest;
    a real peer presents its ticket at once, so the sites' rounds go on meanwhile."""
    import threading

    from isthmus.inter.data.transport.bulk import MAX_UNTICKETED

    with lane_pair(2, "raw", transport="bulk") as ars:
        port = ars[0].server.bulk.port
        threads = threading.active_count()
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
        try:
            # The oldest ones were closed by the server (EOF), the newest still wait.
            wait_until(
                lambda: ars[0].server.refusals.count >= 100 - MAX_UNTICKETED,
                "the server closed the oldest unticketed connections",
            )
            closed_, _, _ = select.select(flood, [], [], 0.5)  # readable: EOF
            assert len(flood) - len(closed_) <= MAX_UNTICKETED, len(closed_)
            assert all(s.recv(1) == b"" for s in closed_)
            assert threading.active_count() - threads <= MAX_UNTICKETED + 4
            assert ars[0].server.refusals.count >= 100 - MAX_UNTICKETED
            data = inputs(2, [50_000], seed=1)
            want = (data[0][0] + data[1][0]) / 2
            results = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, True) for s in range(2)])
            assert not any(isinstance(r, BaseException) for r in results), results
            assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        finally:
            for s in flood:
                s.close()


@pytest.mark.timeout(60)
def test_a_stalled_frame_and_too_many_connections_are_cut_off(lane, monkeypatch) -> None:
    """Issue 33, row 4: 400 frames begun and left open after a ticket held 450 MB and
    400 threads of one rank. A frame whose bytes stop for FRAME_STALL_S is given up,
    and a site's connections past PER_SITE_CONNECTIONS are refused."""
    from isthmus.inter.data.transport import bulk

    monkeypatch.setattr(bulk, "FRAME_STALL_S", 1.0)
    monkeypatch.setattr(bulk, "PER_SITE_CONNECTIONS", 2)
    port, tk = ticket(lane)
    stalled = connect(port, MAGIC + tk)
    assert stalled.recv(1) == bytes([OK])
    msg = raw_chunk().SerializeToString()
    stalled.sendall(frame(msg)[:30])  # a frame begun, then nothing
    port, tk = ticket(lane)
    second = connect(port, MAGIC + tk)
    assert second.recv(1) == bytes([OK])
    port, tk = ticket(lane)
    third = connect(port, MAGIC + tk)
    status, code, why = read_reply(third)
    assert status == REFUSED and code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], why
    assert "site '1' holds 2 bulk connections already" in why
    stalled.settimeout(10)
    assert closed(stalled)  # given up after a second without bytes
    second.sendall(frame(msg))  # the one idle between frames was left alone
    assert read_reply(second)[0] == ACCEPTED
    port, tk = ticket(lane)  # the stalled one's place is free again
    fourth = connect(port, MAGIC + tk)
    assert fourth.recv(1) == bytes([OK])
    for s in (stalled, second, third, fourth):
        s.close()


@pytest.mark.timeout(60)
def test_six_sites_of_sixteen_connections_fit_and_no_site_takes_another_s_share() -> None:
    """Issue 61: a fixed 64 connections per lane deadlocked ``--sites 6 --set
    sync.connections=16`` at step 0 (5 peers x 16 = 80 refused past 64, retried for
    ever). The bound is per site: every peer's most fits, a site past twice the most
    is refused, and that refusal costs the other sites nothing."""
    from isthmus.inter.data.transport.chunk_size import MAX_CONNECTIONS, PER_SITE_CONNECTIONS

    server = LaneServer(site_index=0, num_sites=6, codec="raw", generation=1)
    opened: list[socket.socket] = []
    try:
        for site in range(1, 6):
            for _ in range(MAX_CONNECTIONS):
                opened.append(connect(server.bulk_port, MAGIC + server.tickets.issue(str(site))))
        assert all(s.recv(1) == bytes([OK]) for s in opened)  # 80 at once
        for _ in range(PER_SITE_CONNECTIONS - MAX_CONNECTIONS):  # a stalled flow's redials
            opened.append(connect(server.bulk_port, MAGIC + server.tickets.issue("1")))
            assert opened[-1].recv(1) == bytes([OK])
        opened.append(connect(server.bulk_port, MAGIC + server.tickets.issue("1")))
        status, code, why = read_reply(opened[-1])
        assert status == REFUSED and code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], why
        assert f"site '1' holds {PER_SITE_CONNECTIONS} bulk connections already" in why
        opened.append(connect(server.bulk_port, MAGIC + server.tickets.issue("2")))
        assert opened[-1].recv(1) == bytes([OK])  # site 2 still has its share
        opened[-1].sendall(frame(raw_chunk(from_site=2).SerializeToString()))
        assert read_reply(opened[-1])[0] == ACCEPTED
    finally:
        for s in opened:
            s.close()
        server.stop(0)


_EMFILE_SCRIPT = r"""
import resource, socket, sys, time
from isthmus.inter.data.transport.bulk import BulkListener, MAGIC, REFUSED
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
listener = BulkListener("127.0.0.1", lambda frame, peer, holder: (0, None, ""), 1 << 20, "test")
held = []
try:
    while True:  # until this process (client and server alike) is out of descriptors
        held.append(socket.create_connection(("127.0.0.1", listener.port), timeout=2))
except OSError:
    pass
time.sleep(0.5)  # the listener meets EMFILE on the connections still queued
for s in held:
    s.close()
time.sleep(0.5)
sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
sock.sendall(MAGIC + bytes(32))  # no valid ticket: refused, so someone answered
assert sock.recv(1) == bytes([REFUSED]), "the listener did not answer"
assert listener._thread.is_alive()
print("alive after", listener.refusals.count, "refusals")
"""


@pytest.mark.timeout(60)
def test_the_listener_survives_running_out_of_descriptors() -> None:
    """Issue 33, row 5: when file descriptors ran out, the listener's thread exited
    for good and the lane took no bulk connection again."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EMFILE_SCRIPT], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "alive after" in done.stdout


def test_a_peer_of_the_first_framing_is_told_to_upgrade(lane) -> None:
    port, tk = ticket(lane)
    with connect(port, b"ISTHBULK" + tk) as sock:
        status, code, why = read_reply(sock)
        assert (status, code) == (REFUSED, grpc.StatusCode.FAILED_PRECONDITION.value[0])
        assert "bulk framing version 1" in why and closed(sock)
    assert len(lane.mailbox) == 0


def test_a_lane_not_met_yet_gets_its_ticket_once_its_round_begins() -> None:
    """Sites of unequal sizes: site 1's one lane pairs with both of site 0's, one round
    at a time. Site 0's second lane may ask for a bulk ticket before site 1's round with
    it has begun; site 1's lane then knows only the first lane, which refuses the grant
    (it made no such nonce). That used to fail the second lane's round at once
    (PERMISSION_DENIED, a retried step; 56 s of one in a loaded test run); the asker is
    now told to dial again and its round goes through once site 1 meets it."""
    chunk = 4096
    servers = [
        LaneServer(site_index=s, num_sites=2, codec="raw", generation=7, chunk_bytes=chunk)
        for s in (0, 0, 1)
    ]  # site 0's lanes a and b, site 1's lane c
    a, b, c = servers
    peers = {
        "a->c": LanePeer(c.address, chunk_bytes=chunk),
        "b->c": LanePeer(c.address, chunk_bytes=chunk),
        "c->a": LanePeer(a.address, chunk_bytes=chunk),
        "c->b": LanePeer(b.address, chunk_bytes=chunk),
    }
    # Each all-reduce's configured peer; c's round with b names b's lane instead.
    default_peer = {"a": peers["a->c"], "b": peers["b->c"], "c": peers["c->a"]}
    ars = {
        name: CrossSiteAllReduce(
            membership=FixedMembership(server, {1 - server.site_index: default_peer[name]}),
            codec=make_codec("raw"),
            chunk_bytes=chunk,
            timeout_s=20,
        )
        for name, server in zip("abc", servers, strict=True)
    }
    try:
        first = [torch.full((5000,), 1.0), torch.full((5000,), 2.0)]  # a's and c's
        run_all([
            lambda: ars["a"].allreduce([first[0]], step=0, group=0, average=False),
            lambda: ars["c"].allreduce([first[1]], step=0, group=0, average=False),
        ])  # fmt: skip
        assert torch.equal(first[0], torch.full((5000,), 3.0))
        second = [torch.full((5000,), 10.0), torch.full((5000,), 20.0)]  # b's and c's
        refusals = a.refusals.count

        def c_meets_b_late() -> object:
            # b's round asks c for a ticket meanwhile: c has met only a.
            # (c grants it to a, the one lane it met, and a refuses it: not its nonce)
            wait_until(lambda: a.refusals.count > refusals, "b asked c for a ticket")
            return ars["c"].allreduce(
                [second[1]], step=0, group=1, average=False, peers={0: peers["c->b"]}
            )

        results = run_all([
            lambda: ars["b"].allreduce([second[0]], step=0, group=1, average=False),
            c_meets_b_late,
        ])  # fmt: skip
        assert not any(isinstance(r, BaseException) for r in results), results
        assert torch.equal(second[0], torch.full((5000,), 30.0))
        assert torch.equal(second[1], torch.full((5000,), 30.0))
    finally:
        for ar in ars.values():
            ar.close()
        for peer in peers.values():
            peer.close()
        for server in servers:
            server.stop(0)
