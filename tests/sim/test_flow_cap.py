"""Per-flow caps (`per_flow_mbit`): one TCP flow held to its cap, many flows filling the
link, in both directions, configurable in a topology file and changed by `wan set`.

Rates are low (a 40 Mbit/s link, 10 Mbit/s per flow) and transfers 1-2 s, so that a
busy 2-core machine keeps up: the bounds below are about the emulator's shaping, not
about how fast this machine moves bytes.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, start_wan_up
from measured import assert_rate
from sockets import Server, Sink, connect, send_timed, sink_server

from isthmus.sim import DirectionPipe, DirectionSpec, LinkSpec
from isthmus.sim.link import PIECE_BYTES
from isthmus.sim.topology import apply_changes, parse_topology, spec_to_table

MBIT = 1e6
LINK = 40 * MBIT
CAP = 10 * MBIT
LATENCY_S = 0.005
# A flow may send one piece (64 KiB here) beyond its cap after an idle stretch, the
# token bucket's depth: 3 % of a 2 MiB transfer. 15 % leaves room for timing on a
# busy machine, and is still far below what an uncapped flow gets (4x the cap).
CAP_TOLERANCE = 1.15
WAN = [sys.executable, "-m", "isthmus.deploy.commands.wan"]


def _capped(**overrides: float) -> LinkSpec:
    kwargs = {"latency_s": LATENCY_S, "bandwidth_bps": LINK, "per_flow_bps": CAP, **overrides}
    return LinkSpec.symmetric(**kwargs)


def _flows_rate(address, sink: Sink, flows: int, nbytes: int) -> float:
    """bit/s of `flows` connections sending `nbytes` each at once, from the first send
    to the last byte's arrival (less the one-way latency)."""
    socks = [connect(address) for _ in range(flows)]
    start = sink.received
    try:
        t0 = time.monotonic()
        senders = [threading.Thread(target=s.sendall, args=(b"x" * nbytes,)) for s in socks]
        for t in senders:
            t.start()
        t1 = sink.wait_for(start + flows * nbytes)
        for t in senders:
            t.join(10)
    finally:
        for s in socks:
            s.close()
    return flows * nbytes * 8 / (t1 - t0 - LATENCY_S)


def test_spec_topology_and_changes_carry_the_cap() -> None:
    assert not DirectionSpec(latency_s=0).flow_capped  # 0 = no cap, the default
    assert not DirectionSpec(latency_s=0, per_flow_bps=float("inf")).flow_capped
    for bad in (-1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="per_flow_bps"):
            DirectionSpec(latency_s=0, per_flow_bps=bad)
    topology = parse_topology(
        {
            "sites": ["a", "b"],
            "links": {
                "a-b": {
                    "latency_ms": 5,
                    "bandwidth_mbit": 25000,
                    "per_flow_mbit": 5000,
                    "b_to_a": {"per_flow_mbit": 0},
                }
            },
        }
    )
    spec = topology.spec("a", "b")
    assert spec.a_to_b.per_flow_bps == 5e9 and not spec.b_to_a.flow_capped
    assert apply_changes(spec, {"seed": spec.a_to_b.seed}) == spec  # round-trips
    assert spec_to_table(spec)["a_to_b"]["per_flow_mbit"] == 5000
    lifted = apply_changes(spec, {"a_to_b": {"per_flow_mbit": 0}})
    assert not lifted.a_to_b.flow_capped
    for bad in (-1, "fast", float("inf")):
        with pytest.raises(ValueError, match=r"^links.a-b.a_to_b.per_flow_mbit must be a finite"):
            apply_changes(spec, {"per_flow_mbit": bad}, "links.a-b")


def test_token_bucket_paces_a_flow_with_one_piece_of_credit() -> None:
    # Time is an input here: the bucket is a pure function of (free_at, size, now).
    pipe = DirectionPipe(DirectionSpec(latency_s=0, bandwidth_bps=LINK, per_flow_bps=CAP))
    try:
        piece = pipe.flow_piece_limit()
        assert piece == PIECE_BYTES  # 2 ms of 10 Mbit/s is below the 64 KiB floor
        wire_s = piece * 8 / CAP
        # An idle flow has one piece of credit: its first piece is free at once...
        free = pipe.charge_flow(0.0, piece, now=100.0)
        assert free == pytest.approx(100.0)
        # ...the next one waits its time at the cap.
        free = pipe.charge_flow(free, piece, now=100.0)
        assert free == pytest.approx(100.0 + wire_s)
        # A late wake-up (within the credit) loses no rate.
        free = pipe.charge_flow(free, piece, now=100.0 + wire_s + 0.001)
        assert free == pytest.approx(100.0 + 2 * wire_s)
        pipe.update(DirectionSpec(latency_s=0, bandwidth_bps=LINK))
        assert pipe.charge_flow(free, piece, now=100.0) == 0.0  # no cap: never held
        assert pipe.flow_piece_limit() == pipe.piece_limit()
    finally:
        pipe.close()


@pytest.mark.timeout(60)
def test_one_flow_held_to_cap_and_many_fill_the_link(relay) -> None:
    with sink_server() as (sink, server):
        link = relay.add_link("ab", _capped())
        address = link.add_forward(*server.address)
        # Each rate under its ceiling on every run, its floor reached on one of a few
        # runs (tests/sim/measured.py: load only ever slows a link down).
        with connect(address) as s:
            one = assert_rate(  # ~1.7 s at the cap
                lambda: send_timed(s, sink, 2 << 20, LATENCY_S),
                CAP,
                floor_bps=0.5 * CAP,
                ceiling_bps=CAP * CAP_TOLERANCE,
                what="1 flow",
            )[-1]
        # The cap is per flow, not per link, and the link still bounds them all.
        assert_rate(  # ~1.3 s at the link's rate
            lambda: _flows_rate(address, sink, 4, 1536 << 10),
            LINK,
            floor_bps=2.5 * one,
            ceiling_bps=LINK * 1.10,
            what="4 flows",
        )
        assert_rate(  # many flows fill the link
            lambda: _flows_rate(address, sink, 8, 768 << 10),
            LINK,
            floor_bps=0.6 * LINK,
            ceiling_bps=LINK * 1.10,
            what="8 flows",
        )


@pytest.mark.timeout(60)
def test_cap_holds_each_direction_on_its_own(relay) -> None:
    # b_to_a (answers to the client) capped, a_to_b not: a download is held, an upload not.
    spec = LinkSpec(
        a_to_b=DirectionSpec(latency_s=LATENCY_S, bandwidth_bps=LINK),
        b_to_a=DirectionSpec(latency_s=LATENCY_S, bandwidth_bps=LINK, per_flow_bps=CAP),
    )
    nbytes = 2 << 20

    def send(conn: socket.socket) -> None:
        with conn:
            conn.recv(1)
            conn.sendall(b"y" * nbytes)

    sink = Sink()
    servers = [Server(send), Server(sink)]
    try:
        link = relay.add_link("ab", spec)
        download, upload = (
            link.add_forward(*servers[0].address),
            link.add_forward(*servers[1].address),
        )

        def down() -> float:
            with connect(download) as s:
                t0 = time.monotonic()
                s.sendall(b"g")  # one byte: one left unread would make close() send RST
                got = 0
                while got < nbytes and (data := s.recv(1 << 20)):
                    got += len(data)
                assert got == nbytes
                return nbytes * 8 / (time.monotonic() - t0 - 2 * LATENCY_S)

        def up() -> float:
            with connect(upload) as s:
                return send_timed(s, sink, 4 << 20, LATENCY_S)

        # Under each ceiling on every run, the floor on one of a few (measured.py).
        assert_rate(
            down, CAP, floor_bps=0.5 * CAP, ceiling_bps=CAP * CAP_TOLERANCE, what="capped download"
        )
        # The other direction is not capped, only bound by the link.
        assert_rate(up, LINK, floor_bps=2 * CAP, ceiling_bps=LINK * 1.10, what="uncapped upload")
    finally:
        for server in servers:
            server.close()


@pytest.mark.timeout(60)
def test_wan_up_and_set_per_flow_mbit(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(
        'sites = ["a", "b"]\n[links."a-b"]\nlatency_ms = 5\nbandwidth_mbit = 40\n'
        "per_flow_mbit = 10\n"
    )
    sink = Sink()
    server = Server(sink)
    target = f"127.0.0.1:{server.address[1]}"
    up, lines = start_wan_up(topology, "--forward", f"a:b={target}")

    def wan(*args: str) -> subprocess.CompletedProcess:
        cmd = [*WAN, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)

    try:
        assert any("10 Mbit/s per flow" in line for line in lines), lines
        forward = next(line.split()[1] for line in lines if line.startswith("forward"))
        control = next(line.split()[1] for line in lines if line.startswith("control"))
        host, port = forward.split(":")
        with connect((host, int(port))) as s:
            capped = send_timed(s, sink, 1 << 20, LATENCY_S)
            for bad, needle in (("-1", "got -1"), ("abc", "got 'abc'")):
                refused = wan("set", "--control", control, "a-b", f"per_flow_mbit={bad}")
                assert_one_line_error(refused, "links.a-b.a_to_b.per_flow_mbit", needle)
            lifted = wan("set", "--control", control, "a-b", "per_flow_mbit=0")
            assert lifted.returncode == 0, lifted.stderr
            assert "per flow" not in lifted.stdout
            # The same live connection, no longer capped: above twice the capped rate
            # on one of a few runs, never above the link (measured.py).
            assert_rate(
                lambda: send_timed(s, sink, 4 << 20, LATENCY_S),
                LINK,
                floor_bps=2 * capped,
                ceiling_bps=LINK * 1.10,
                what="lifted cap",
            )
        print(f"wan set per_flow_mbit: 10 -> {capped / MBIT:.1f} Mbit/s")
        assert capped <= CAP * CAP_TOLERANCE
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(10)
        server.close()
