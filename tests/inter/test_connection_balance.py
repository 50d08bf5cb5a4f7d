"""A peer's rounds share its connections, and each chunk goes on the least loaded one
(inter/data/transport/peer_round.py, ``PeerRound.send``): real bulk connections to a real lane on
loopback, each connection told apart at the lane by its address.

Before, each round took the connections in turn from the first, so a round of 4 frames
over 3 connections put 2 on the first every time: held to a per-flow cap, that one
connection set the pace of every round (1x H200, 25 Gbit/s with 5 Gbit/s a flow, 8
groups of 256 MiB: 71-75 % of the link against 84-89 % for one round of 2 GiB).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
from helpers import raw_chunk, wait_until

from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.transport.bulk_peer import BulkConnection
from isthmus.inter.data.transport.peer_round import PeerRound
from isthmus.inter.data.transport.wire import Frame

pytestmark = pytest.mark.timeout(60)


def connections(server: LaneServer, n: int) -> list[BulkConnection]:
    return [
        BulkConnection(
            "127.0.0.1",
            lambda timeout: (server.bulk_port, server.tickets.issue("1")),
            proxy=None,
            name=f"site1-to-site0-{i}",
        )
        for i in range(n)
    ]


def frame(step: int, group: int, values: int) -> Frame:
    """A one-chunk round's chunk of ``values`` fp32 values (a chunk a group)."""
    return Frame.from_message(raw_chunk(values, step=step, group=group).SerializeToString())


def count_takes(monkeypatch, hold_s: float = 0.0) -> collections.Counter:
    """Chunks the lane takes, by the connection (peer address) they came on; each take
    first waits ``hold_s`` (a peer that has not read them yet)."""
    seen: collections.Counter = collections.Counter()
    lock = threading.Lock()
    original = LaneServer.take

    def take(self, req, holder=None, peer=""):
        time.sleep(hold_s)
        with lock:
            seen[peer] += 1
        return original(self, req, holder, peer)

    monkeypatch.setattr(LaneServer, "take", take)
    return seen


def test_rounds_one_after_another_spread_their_frames_over_every_connection(
    monkeypatch, lane: LaneServer
) -> None:
    seen = count_takes(monkeypatch)
    conns = connections(lane, 3)
    try:
        for step in range(3):  # three rounds of 4 frames, each frame taken before the next
            rnd = PeerRound(conns, deadline=time.monotonic() + 30)
            for group in range(4):
                rnd.send(frame(step, group, 256))
                # Every connection idle again: the pick is by bytes ever queued alone,
                # whatever the order the acknowledgements came back in.
                wait_until(lambda: all(c.load()[0] == 0 for c in conns), "the frame taken", 20)
            rnd.end()
            assert rnd.wait(20) == 4
        # 12 frames over 3 connections: 4 each (in turn from the first: 6, 3, 3).
        assert sorted(seen.values()) == [4, 4, 4], seen
        assert [conn.load() for conn in conns] == [(0, 4 * 1024)] * 3
    finally:
        for conn in conns:
            conn.close()


def test_frames_go_around_a_connection_whose_bytes_are_not_yet_taken(
    monkeypatch, lane: LaneServer
) -> None:
    seen = count_takes(monkeypatch, hold_s=1.0)  # nothing is acknowledged for a second
    conns = connections(lane, 2)
    try:
        big = PeerRound(conns, deadline=time.monotonic() + 30)
        big.send(frame(0, 0, 4096))  # 16 KiB on the first connection
        small = PeerRound(conns, deadline=time.monotonic() + 30)
        for c in range(4):  # 4 KiB each: the second connection has room for all four
            small.send(frame(1, c, 1024))
        assert [conn.load()[1] for conn in conns] == [16384, 4 * 4096]
        big.end()
        small.end()
        assert big.wait(20) == 1 and small.wait(20) == 4
        assert sorted(seen.values()) == [1, 4], seen
    finally:
        for conn in conns:
            conn.close()
