"""A bulk connection whose frames miss their deadline is given up and its frames go on
a new connection (inter/data/transport/bulk_peer.py; issue 32, item 2): real lanes on loopback,
the receiving lane held in its ``take`` as a peer that stops reading, or an ack that
never comes back, would hold it; and two sites across the WAN emulator whose link
black-holes one flow each way in the middle of a round (``flow_stall``).

The loopback tests use the module's own rule with a shorter floor (``STALL_FLOOR_S``),
so each takes seconds instead of the default's several; the emulated one the defaults.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import raw_chunk, wait_until
from lanes import inputs, run_all, same_bits, two_sites_over
from sockets import Server

from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import CrossSiteError
from isthmus.inter.data.transport import bulk_peer, flow_clock
from isthmus.inter.data.transport.bulk_peer import BulkConnection
from isthmus.inter.data.transport.peer_round import PeerRound
from isthmus.inter.data.transport.wire import Frame
from isthmus.inter.security import SiteSecurity
from isthmus.sim import LinkSpec
from isthmus.sim.impairments.flow_stall import FlowStall

pytestmark = pytest.mark.timeout(60)

HOLD_S = 8.0
"""How long the receiving lane holds the first chunk: far past the shortened deadline
(0.5 s), so a round that ends sooner than this ended through the stall."""


def connection(server: LaneServer) -> BulkConnection:
    """A bulk connection of site 1 to ``server``, admitted by tickets the lane grants
    to site 1 (how a ticket travels is tests/inter/test_sender_bound_chunks.py's)."""
    return BulkConnection(
        "127.0.0.1",
        lambda timeout: (server.bulk_port, server.tickets.issue("1")),
        proxy=None,
        name="site1-to-site0",
    )


def frames(n: int) -> list[Frame]:
    return [
        Frame.from_message(raw_chunk(step=0, group=g).SerializeToString())  # a chunk a group
        for g in range(n)
    ]


def send_round(conn: BulkConnection, n: int, wait_s: float) -> tuple[PeerRound, float]:
    """``n`` frames in one round over ``conn``, every one taken within ``wait_s``: the
    round and how long it took."""
    start = time.monotonic()
    rnd = PeerRound([conn], deadline=start + 30)
    for f in frames(n):
        rnd.send(f)
    rnd.end()
    assert rnd.wait(wait_s) == n
    return rnd, time.monotonic() - start


def hold_takes(monkeypatch, lane: LaneServer, hold: dict[int, float], after: bool) -> dict:
    """The lane's ``take`` sleeps ``hold[k]`` seconds on its k-th call (0-based), before
    it stores the chunk (a peer that stopped reading) or after it (the chunk is stored,
    its acknowledgement late: lost on the way back, as far as the sender can tell)."""
    calls = {"n": 0, "done": 0}
    lock = threading.Lock()
    original = LaneServer.take

    def take(self, req, holder=None, peer=""):
        with lock:
            k = calls["n"]
            calls["n"] += 1
        if not after:
            time.sleep(hold.get(k, 0.0))
        answer = original(self, req, holder, peer)
        if after:
            time.sleep(hold.get(k, 0.0))
        with lock:
            calls["done"] += 1
        return answer

    monkeypatch.setattr(LaneServer, "take", take)
    return calls


@pytest.mark.parametrize("after", [False, True], ids=["peer-stops-reading", "ack-lost"])
def test_a_stalled_connection_sends_its_frames_again_on_a_new_one(
    monkeypatch, lane: LaneServer, after: bool
) -> None:
    monkeypatch.setattr(flow_clock, "STALL_FLOOR_S", 0.5)
    calls = hold_takes(monkeypatch, lane, {0: HOLD_S}, after)
    conn = connection(lane)
    try:
        rnd, took = send_round(conn, 3, wait_s=10)
        # The first frame's deadline (0.5 s past its size at the first rate) passed,
        # its connection was closed and the three frames went on a new one: well
        # before the held take returns (8 s), let alone TCP_USER_TIMEOUT (30 s).
        assert took < HOLD_S - 2, took
        assert conn.stalls == 1 and rnd.stalls == 1
        assert rnd.resent == 0
        # The held take returns on a connection nobody reads: every chunk is stored
        # once, whichever copy came first.
        wait_until(lambda: calls["done"] == calls["n"] >= 4, "the held take returned", HOLD_S + 10)
        # At least the held copy and the three on the new connection (the old one may
        # still read what it had buffered before its ack fails).
        stored = lane.mailbox.keys()
        assert sorted(group for _, group, *_ in stored) == [0, 1, 2]
    finally:
        conn.close()


def test_a_slow_connection_that_keeps_acknowledging_is_not_stalled(
    monkeypatch, lane: LaneServer
) -> None:
    """Fifteen frames a fifth of a second apart take 3 s, past the floor of 2.5 s: each
    deadline counts from the acknowledgement before it, so none is missed."""
    monkeypatch.setattr(flow_clock, "STALL_FLOOR_S", 2.5)
    hold_takes(monkeypatch, lane, dict.fromkeys(range(15), 0.2), after=False)
    conn = connection(lane)
    try:
        rnd, took = send_round(conn, 15, wait_s=30)
        assert took >= 3.0
        assert conn.stalls == 0 and rnd.stalls == 0
        assert len(lane.mailbox) == 15
    finally:
        conn.close()


def test_the_deadline_follows_the_measured_rate() -> None:
    """A frame's deadline: from when it could begin to be taken, its size at the
    measured rate (first: ``FIRST_RATE_BPS``) times the slack, plus the floor; a
    stall in a row doubles it, an acknowledgement puts it back."""
    clock = flow_clock.FlowClock()
    frame = frames(1)[0]
    size = frame.payload_bytes + len(frame.header)
    assert clock.due(None, size) == float("inf")  # nothing in flight
    first = flow_clock.RATE_SLACK * size / flow_clock.FIRST_RATE_BPS + flow_clock.STALL_FLOOR_S
    assert clock.due(100.0, size) == pytest.approx(100.0 + first)
    # Acknowledged after 1 s: the rate is what that frame moved in it.
    clock.acknowledged(100.0, size, 101.0)
    assert clock.rate == pytest.approx(size / 1.0)
    want = 101.0 + flow_clock.RATE_SLACK * 1.0 + flow_clock.STALL_FLOOR_S
    assert clock.due(100.5, size) == pytest.approx(want)  # sent before that ack
    clock.stalled()
    assert clock.due(100.5, size) == pytest.approx(101.0 + 2 * (want - 101.0))
    clock.acknowledged(100.5, size, 102.0)
    assert clock.backoff == 1


def closing_in_hello():
    """A listener that takes each connection and closes it before any answer (a lane
    dropping its connections while one is being opened)."""
    return Server(lambda conn: conn.close())


def test_a_connection_closed_before_its_answer_is_dialled_again(lane) -> None:
    """The first connection is closed in its hello; the second, to the lane itself,
    carries the round (before: the round failed, "connection closed by the peer")."""
    hole, dials = closing_in_hello(), []

    def open_bulk(timeout: float) -> tuple[int, bytes]:
        dials.append(timeout)
        port = hole.address[1] if len(dials) == 1 else lane.bulk_port
        return port, lane.tickets.issue("1")

    conn = BulkConnection("127.0.0.1", open_bulk, proxy=None, name="site1-to-site0")
    try:
        rnd, _took = send_round(conn, 3, wait_s=20)
        assert rnd.failure() is None and len(dials) == 2
    finally:
        conn.close()
        hole.close()


def test_a_peer_that_closes_every_hello_fails_the_round_long_before_its_deadline() -> None:
    hole = closing_in_hello()
    conn = BulkConnection(
        "127.0.0.1", lambda timeout: (hole.address[1], b"t" * 32), proxy=None, name="t"
    )
    start = time.monotonic()
    rnd = PeerRound([conn], deadline=start + 30)
    try:
        for f in frames(2):
            rnd.send(f)
        rnd.end()
        with pytest.raises(ConnectionError, match="closed by the peer|reset by peer"):
            rnd.wait(25)
        # MAX_HELLO_CLOSES + 1 dials, 0.05 + 0.1 + 0.2 s apart.
        assert len(hole.conns) == bulk_peer.MAX_HELLO_CLOSES + 1
        assert time.monotonic() - start < 5
    finally:
        conn.close()
        hole.close()


def _round_across_a_stalled_flow(
    monkeypatch, floats: int = 1 << 20, **over
) -> tuple[list, torch.Tensor, float, dict]:
    """Two sites, four connections each way over an emulated 400 Mbit/s link; once
    the connections are up, the link holds the first flow each way that carries 64 KiB
    (a lane's flow, not a gRPC channel's pings) for 60 s (an ECMP path gone), under a
    round of ``floats`` fp32 a site. Returns the round's results, the exact sum, its
    seconds and the link's stats."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")
    spec = LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=400e6)
    with two_sites_over(spec, chunk_bytes=256 * 1024, connections=4, timeout_s=60, **over) as (
        ars,
        _servers,
        link,
    ):
        warm = inputs(2, [1 << 18], seed=1)  # every connection dialled before the stall
        res = run_all([lambda s=s: ars[s].allreduce(warm[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        stall = (FlowStall(count=1, duration_s=60.0, min_bytes=1 << 16),)
        link.set_impairments(a_to_b=stall, b_to_a=stall)
        res, want, took = _exact_round(ars, floats, seed=7)  # 4 MiB a site: 8 chunks each way
        return res, want, took, link.stats()


def drop_after_first_chunk_of_step(listener, step: int) -> None:
    """``listener`` drops every connection once it has stored the first chunk of
    ``step``, before that chunk's acknowledgement goes back: the drop shuts the
    connections (this one too) from the thread that is about to acknowledge it."""
    accept, dropped = listener._accept, threading.Event()

    def accept_then_drop(chunk, peer, holder):
        answer = accept(chunk, peer, holder)
        if chunk.step == step and not dropped.is_set():
            dropped.set()
            listener.drop_connections()
        return answer

    listener._accept = accept_then_drop


def _exact_round(ars: list, floats: int, seed: int) -> tuple[list, torch.Tensor, float]:
    """Step 1 of two sites' all-reduce of ``floats`` fp32 a site: it must end exact and
    identical at both. Returns the results, the sum and the seconds it took."""
    data = inputs(2, [floats], seed=seed)
    want = data[0][0] + data[1][0]
    start = time.monotonic()
    res = run_all(
        [lambda s=s: ars[s].allreduce(data[s], 1, 0, False) for s in range(2)], timeout=50
    )
    took = time.monotonic() - start
    assert not any(isinstance(r, BaseException) for r in res), res
    assert same_bits(data[0][0], want) and same_bits(data[1][0], want)
    assert torch.isfinite(want).all()
    return res, want, took


def test_a_round_across_a_link_that_black_holes_a_flow_each_way_goes_on_exact(
    monkeypatch,
) -> None:
    """On the bulk port: the round ends exact and identical at both sites within the
    default deadlines (3 s past a frame's expected time, a redial), where without them
    it would wait the stall out, or fail at its 60 s timeout."""
    res, _want, took, stats = _round_across_a_stalled_flow(monkeypatch)
    assert stats["a_to_b"]["stalled_flows"] == stats["b_to_a"]["stalled_flows"] == 1
    # The held flows were lanes' bulk connections (the round's only traffic): each
    # site's round saw its own stall and went on.
    assert sum(r.stalled_flows for r in res) >= 1, res
    assert took < 25, took


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
@pytest.mark.parametrize("floats", [1 << 20, 1 << 17], ids=["4MiB", "512KiB"])
def test_under_mutual_tls_a_chunk_whose_connection_went_dark_goes_again(
    job_dir, monkeypatch, floats: int, transport: str
) -> None:
    """Under mutual TLS, on the bulk port inside TLS (bulk_stream.py) and on gRPC, where
    each chunk is a ``PushChunks`` call of its own answered once stored, with the bulk
    port's deadline (push_round.py): the held connection's oldest frame or call misses
    it, a new connection is dialled and the chunks in flight go on it. The round ends
    exact and identical at both sites and counts the stall, where before it failed at
    its 60 s timeout and the step was retried. So does a small round (two chunks each
    way, what the chaos suite's tiny model sends): there a gRPC stream acknowledged as
    a whole went unnoticed, its keepalive pings answered."""

    def security(site: int) -> SiteSecurity:
        return SiteSecurity.load(job_dir, f"site{site}", require_tls=True, require_token=True)

    res, _want, took, stats = _round_across_a_stalled_flow(
        monkeypatch, floats, security=security, transport=transport
    )
    assert stats["a_to_b"]["stalled_flows"] == stats["b_to_a"]["stalled_flows"] == 1
    assert sum(r.stalled_flows for r in res) >= 1, res
    assert took < 15, took  # the default deadlines: 3 s past a chunk's expected time


@pytest.mark.parametrize(
    ("transport", "failure"),
    [
        ("bulk", "connection lost .connection closed by the peer. and no new one within 3s"),
        ("grpc", "UNAVAILABLE"),
    ],
)
def test_under_mutual_tls_a_peer_whose_lane_goes_away_fails_the_round_at_once(
    job_dir, monkeypatch, transport: str, failure: str
) -> None:
    """The other side of sending a lost connection's chunks again: when the peer's lane
    is gone (its process died) while chunks are on the way, the calls made again do not
    wait for the peer to come back (no wait-for-ready), so the round fails within
    seconds, naming the site, not at its 60 s deadline."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")

    def security(site: int) -> SiteSecurity:
        return SiteSecurity.load(job_dir, f"site{site}", require_tls=True, require_token=True)

    # 40 Mbit/s: site 0's 8 MiB for site 1 take ~1.7 s, so the lane stops under them.
    spec = LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=40e6)
    with two_sites_over(
        spec,
        chunk_bytes=256 * 1024,
        connections=2,
        timeout_s=60,
        security=security,
        transport=transport,
    ) as (ars, servers, _link):
        warm = inputs(2, [1 << 16], seed=1)  # connections up, as in a running job
        res = run_all([lambda s=s: ars[s].allreduce(warm[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        # Site 1 never starts step 1: its lane stops while site 0's chunks are on the way.
        threading.Timer(0.5, servers[1].stop, args=(0,)).start()
        start = time.monotonic()
        with pytest.raises(CrossSiteError, match=f"sending to site 1 failed: {failure}"):
            ars[0].allreduce(inputs(2, [1 << 22], seed=2)[0], 1, 0, False)
        assert time.monotonic() - start < 15


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_bulk_connection_lost_under_its_frames_sends_them_again_and_the_round_goes_on(
    job_dir, monkeypatch, tls: bool
) -> None:
    """Site 1's listener drops every bulk connection while site 0's chunks are on them
    (a reset; under TLS what a record failing its MAC ends in): site 0 sends the frames
    in flight again on new connections (bulk_peer.py, ``_lost``), the round ends exact
    at both sites and counts the flows left, where before it failed and the step was
    retried (the chaos suite's corrupt scenario under TLS: 14 retries in 10 steps)."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")

    def security(site: int) -> SiteSecurity | None:
        return SiteSecurity.load(job_dir, f"site{site}", require_tls=True) if tls else None

    # 40 Mbit/s: 4 MiB a site take ~1 s each way: after the first of 16 chunks, more are
    # on the connections when they drop (a timer could fire before the round began, on
    # a busy machine, or in a second connection's TLS handshake).
    spec = LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=40e6)
    with two_sites_over(
        spec, chunk_bytes=256 * 1024, connections=2, timeout_s=60, security=security
    ) as (ars, servers, _link):
        warm = inputs(2, [1 << 16], seed=1)  # connections up, as in a running job
        res = run_all([lambda s=s: ars[s].allreduce(warm[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        drop_after_first_chunk_of_step(servers[1].bulk, step=1)
        res, _want, took = _exact_round(ars, 1 << 20, seed=3)
        assert res[0].stalled_flows >= 1, res  # site 0's connections to site 1 were left
        assert took < 15, took
