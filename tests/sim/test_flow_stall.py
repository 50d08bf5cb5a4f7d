"""`flow_stall` on live loopback links: one connection of a direction goes dark for its
duration and then delivers every byte in order, while the direction's other
connections, started at the same time or later, keep their rate; through both relay
front-ends (forward, CONNECT proxy) and both pump modes (threads, processes).

Plus the spec's validation and the impairment's pure logic.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import threading
import time
from collections import Counter

import pytest
from measured import assert_delay
from sockets import Server, connect

from isthmus.sim import FlowStall, LinkSpec, impairments
from isthmus.sim.impairments import Piece, State
from isthmus.sim.topology import apply_changes, parse_topology, spec_to_table

MBIT = 1e6
LATENCY_S = 0.005
DARK_S = 1.5
# A 512 KiB transfer takes ~45 ms at 100 Mbit/s. Starved attempts on a loaded 2-core
# machine ran ~2-3x slower; half the dark period is still far above that, and far
# below what a connection shows when the whole direction is dark (~DARK_S).
UNSTALLED_BOUND_S = DARK_S / 2
# The stalled connection's first byte arrives DARK_S after its first piece (plus the
# latency); 0.3 s of room above it for a late pump or test thread, none below: the
# emulator never delivers a held byte early.
STALL_TOLERANCE_S = 0.3
PAYLOAD_BYTES = 512 << 10
STALLED_PAYLOAD_BYTES = 1 << 20  # past its receive window: its sender feels backpressure


class Received:
    """What a loopback server received, per connection: keyed by the connection's first
    16 bytes (each payload is random), when its first byte and its EOF came, its hash."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.flows: dict[bytes, tuple[float, float, str]] = {}

    def __call__(self, conn: socket.socket) -> None:
        first_at, digest, head = None, hashlib.sha256(), b""
        with conn:
            while data := conn.recv(1 << 20):
                first_at = first_at or time.monotonic()
                head = (head + data)[:16] if len(head) < 16 else head
                digest.update(data)
        with self.cond:
            self.flows[head] = (first_at or time.monotonic(), time.monotonic(), digest.hexdigest())
            self.cond.notify_all()

    def wait(self, payload: bytes, timeout: float = 20) -> tuple[float, float]:
        """(first byte, EOF) times of the connection that sent `payload`; asserts that
        it arrived whole and in order."""
        with self.cond:
            assert self.cond.wait_for(lambda: payload[:16] in self.flows, timeout)
            first_at, eof_at, digest = self.flows[payload[:16]]
        assert digest == hashlib.sha256(payload).hexdigest(), "bytes lost or reordered"
        return first_at, eof_at


def _open(link, front: str, target) -> socket.socket:
    """A connection to `target` through the link: a forward listener or a CONNECT."""
    if front == "forward":
        return connect(link.add_forward(*target))
    s = connect(link.add_proxy())
    s.sendall(f"CONNECT {target[0]}:{target[1]} HTTP/1.1\r\n\r\n".encode())
    answer = b""
    while not answer.endswith(b"\r\n\r\n"):
        more = s.recv(1)
        assert more, answer
        answer += more
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    return s


def _send(sock: socket.socket, payload: bytes) -> threading.Thread:
    def run() -> None:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_stalled(link, flows: int, timeout: float = 10) -> None:
    """Until the link's a_to_b direction has picked `flows` connections."""
    deadline = time.monotonic() + timeout
    while link.stats()["a_to_b"].get("stalled_flows", 0) < flows:
        assert time.monotonic() < deadline, link.stats()
        time.sleep(0.002)


def _spec(*chain) -> LinkSpec:
    return LinkSpec.symmetric(latency_s=LATENCY_S, bandwidth_bps=100 * MBIT, impairments=chain)


def _stall_one_of_three(relay, attempt: list[int], front: str) -> float:
    """One measurement on a fresh link: the stalled connection's delay to its first byte.

    Three connections are opened; `flow_stall` is put on the live link; the first one
    sends and is picked, then the other two send at once. Asserts on every attempt
    what load cannot explain: all bytes arrive in order, one connection was picked,
    and the other two were not held for anything like the dark period."""
    attempt[0] += 1
    link = relay.add_link(f"ab{attempt[0]}", _spec())
    received = Received()
    server = Server(received)
    socks: list[socket.socket] = []
    try:
        socks += (_open(link, front, server.address) for _ in range(3))
        stalled, *others = socks
        link.set_impairments(a_to_b=(FlowStall(count=1, duration_s=DARK_S),))
        payloads = [os.urandom(STALLED_PAYLOAD_BYTES)]
        payloads += [os.urandom(PAYLOAD_BYTES) for _ in others]
        t_stalled = time.monotonic()
        senders = [_send(stalled, payloads[0])]
        _wait_stalled(link, 1)
        t_others = time.monotonic()
        senders += [_send(s, p) for s, p in zip(others, payloads[1:], strict=True)]
        others_s = [received.wait(p)[1] - t_others for p in payloads[1:]]
        first_at, _ = received.wait(payloads[0])
        for t in senders:
            t.join(10)
        delay = first_at - t_stalled
        print(f"flow_stall: stalled {delay:.3f} s, others done in {others_s} s")
        assert max(others_s) < UNSTALLED_BOUND_S, others_s  # not held with the stalled one
        stats = link.stats()["a_to_b"]
        assert stats["stalled_flows"] == 1, stats
        assert stats["flow_held_bytes"] > 0 and "held_bytes" not in stats, stats
        return delay
    finally:
        for s in socks:
            s.close()
        server.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("front", ["forward", "proxy"])
def test_one_flow_goes_dark_while_the_others_flow(either_relay, front: str) -> None:
    attempt = [0]
    assert_delay(
        lambda: _stall_one_of_three(either_relay, attempt, front),
        DARK_S + LATENCY_S,
        STALL_TOLERANCE_S,
        hard_floor_s=DARK_S,  # a held byte never arrives early, whatever the load
        what="flow_stall's dark period",
    )


@pytest.mark.timeout(60)
def test_a_connection_opened_after_the_picked_one_is_not_stalled(either_relay) -> None:
    # In the spec from the start: each CONNECT's crossing (a piece of no connection)
    # meets the impairment first, and must neither be held nor count as a flow.
    link = either_relay.add_link("ab", _spec(FlowStall(count=1, duration_s=DARK_S)))
    received = Received()
    server = Server(received)
    try:
        with _open(link, "proxy", server.address) as picked:
            held = os.urandom(PAYLOAD_BYTES)
            t_picked = time.monotonic()
            _send(picked, held)
            _wait_stalled(link, 1)
            with _open(link, "proxy", server.address) as later:
                payload = os.urandom(PAYLOAD_BYTES)
                t_later = time.monotonic()
                _send(later, payload)
                _, later_eof = received.wait(payload)
                picked_first, _ = received.wait(held)
        print(f"later one done in {later_eof - t_later:.3f} s, picked one waited "
              f"{picked_first - t_picked:.3f} s")  # fmt: skip
        assert later_eof - t_later < UNSTALLED_BOUND_S
        assert picked_first - t_picked >= DARK_S
        assert later_eof < picked_first  # the later one was done while the first was dark
        assert link.stats()["a_to_b"]["stalled_flows"] == 1
    finally:
        server.close()


# -- spec and pure logic: no sockets ------------------------------------------------


def test_flow_stall_spec_is_validated_naming_the_field() -> None:
    make = impairments.impairment_from_dict
    for table, needle in (
        ({"kind": "flow_stall", "duration_s": 1, "count": 0}, "flow_stall.count"),
        ({"kind": "flow_stall", "duration_s": 1, "count": -2}, "flow_stall.count"),
        ({"kind": "flow_stall", "duration_s": 1, "count": True}, "flow_stall.count"),
        ({"kind": "flow_stall", "duration_s": 1, "count": 1.0}, "flow_stall.count"),
        ({"kind": "flow_stall", "duration_s": 1, "min_bytes": 0}, "flow_stall.min_bytes"),
        ({"kind": "flow_stall", "duration_s": 1, "min_bytes": 1.5}, "flow_stall.min_bytes"),
        ({"kind": "flow_stall", "duration_s": 1, "at_s": -0.1}, "flow_stall.at_s"),
        ({"kind": "flow_stall", "duration_s": -1}, "flow_stall.duration_s"),
        ({"kind": "flow_stall", "duration_s": float("inf")}, "flow_stall.duration_s"),
        ({"kind": "flow_stall"}, "duration_s"),
        ({"kind": "flow_stall", "duration_s": 1, "flows": 2}, "unknown key 'flows'"),
    ):
        with pytest.raises(ValueError, match=needle):
            make(table)
    table = {"kind": "flow_stall", "count": 1, "at_s": 0.5, "duration_s": 60, "min_bytes": 1}
    stall = make(table)
    assert stall == FlowStall(count=1, at_s=0.5, duration_s=60)
    assert list(stall.to_dict().items()) == list(table.items())  # the file's order too
    assert make(stall.to_dict()) == stall
    # From a topology file's table, and back.
    topology = parse_topology(
        {
            "sites": ["a", "b"],
            "links": {"a-b": {"latency_ms": 5, "bandwidth_mbit": 100, "impairments": [table]}},
        }
    )
    (link,) = topology.links
    assert link.spec.a_to_b.impairments == (stall,) == link.spec.b_to_a.impairments
    assert spec_to_table(link.spec)["a_to_b"]["impairments"] == [stall.to_dict()]
    # As `isthmus wan set` changes a live link's direction.
    changed = apply_changes(
        LinkSpec.symmetric(latency_s=0.005), {"a_to_b": {"impairments": [table]}}
    )
    assert changed.a_to_b.impairments == (stall,) and changed.b_to_a.impairments == ()


def _state(installed_at: float = 10.0) -> State:
    return State(rng=random.Random(0), installed_at=installed_at, counters=Counter())


def test_flow_stall_picks_count_flows_after_at_s_each_dark_from_its_pick() -> None:
    stall = FlowStall(count=2, at_s=1.0, duration_s=0.5)
    state = _state()
    stall.start(state, 10.0)

    def at(flow: int, t: float, size: int = 100) -> float:
        piece = Piece(data=None, size=size, wire_at=t, at=t, flow=flow)
        stall.apply(piece, state, t)
        return piece.at

    assert at(0, 10.5) == 10.5  # before at_s: left alone, not picked
    assert at(-1, 11.0) == 11.0  # no connection: never held, never picked
    assert at(1, 11.0, size=0) == 11.0  # an EOF alone does not pick its flow
    assert at(0, 11.2) == pytest.approx(11.7)  # picked: dark until 11.7
    assert at(0, 11.5) == pytest.approx(11.7)
    assert at(1, 11.4) == pytest.approx(11.9)  # picked second, dark from its own pick
    assert at(1, 11.6, size=0) == pytest.approx(11.9)  # its EOF is held too
    assert at(2, 11.4) == 11.4  # count reached: later flows flow
    assert at(0, 11.8) == 11.8  # after its dark period
    assert state.counters == {"stalled_flows": 2, "flow_held_bytes": 300}


def test_flow_stall_picks_a_flow_once_it_carried_min_bytes() -> None:
    """A channel's small messages (a 17-byte ping) never pick it; the bulk flow whose
    bytes reach ``min_bytes`` is picked by the piece that reaches it."""
    stall = FlowStall(duration_s=1.0, min_bytes=1000)
    state = _state()
    stall.start(state, 10.0)

    def at(flow: int, t: float, size: int) -> float:
        piece = Piece(data=None, size=size, wire_at=t, at=t, flow=flow)
        stall.apply(piece, state, t)
        return piece.at

    assert at(0, 10.1, 17) == 10.1  # a ping
    assert at(1, 10.2, 600) == 10.2  # 600 of 1000
    assert at(0, 10.3, 17) == 10.3
    assert at(1, 10.4, 600) == pytest.approx(11.4)  # 1200: picked, held from here
    assert at(1, 10.5, 10) == pytest.approx(11.4)
    assert at(0, 10.6, 5000) == 10.6  # count reached: flow 0 is left alone
    assert state.counters == {"stalled_flows": 1, "flow_held_bytes": 610}


def test_every_impairment_takes_a_piece_with_no_flow() -> None:
    examples = {
        "jitter": {"ms": 1},
        "loss": {"rate": 1.0},
        "flap": {"duration_s": 1},
        "flow_stall": {"duration_s": 1},
        "reset": {"rate": 1.0},
        "corrupt": {"rate": 1.0},
        "slice": {"size_bytes": 10},
    }
    assert set(examples) == set(impairments.KINDS)  # a new kind is added here too
    for kind, params in examples.items():
        imp = impairments.impairment_from_dict({"kind": kind, **params})
        state = _state(0.0)
        imp.start(state, 0.0)
        piece = Piece(data=b"x" * 100, wire_at=1.0, at=1.0)
        assert piece.flow == -1
        imp.apply(piece, state, 0.5)
