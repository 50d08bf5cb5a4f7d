"""The emulator at line rate: RTT within max(5 %, 0.2 ms) of the spec down to 0.5 ms,
5 Gbit/s never exceeded and within 10 % where the host carries 1.5x it (less where it
is busy: the test measures what it carries), bytes in flight bounded at that rate, and
spliced and copied pieces (an impairment that reads the bytes comes and goes) kept in
order. The tight 5 Gbit/s figure on a quiet machine is benchmarks/wan_throughput.py's.

The sink and the echo server run in a child process, so that the test's own threads
share the GIL only with the relay's pumps, as a program behind `isthmus wan up` would
not at all; the figures are medians, since other jobs on a 2-core CI machine delay
single pings and bursts by milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import pytest
from helpers import load_benchmark, wait_until
from measured import assert_delay

from isthmus.sim import Corrupt, LinkSpec
from isthmus.sim.clock import PUMP_NICE

GBIT = 1e9
STATS = struct.Struct("!QQ")  # bytes after the first read, ns from its end to the last
send_until = load_benchmark("wan_probe").send_until  # the benchmark's sender, as it measures

SERVERS = r"""
import json, os, socket, struct, sys, threading, time
try:
    os.setpriority(os.PRIO_PROCESS, 0, -10)  # as the relay's pumps (sim/clock.py)
except OSError:
    pass
def sink(conn):
    buf, total, first, last = bytearray(1 << 20), -1, 0, 0
    with conn:
        while n := conn.recv_into(buf):
            last = time.perf_counter_ns()
            if total < 0:  # from the end of the first read: it may hold a backlog
                first, total = last, 0
            else:
                total += n
        conn.sendall(struct.pack("!QQ", max(total, 0), last - first))
def echo(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
def serve(handler):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    def accept():
        while True:
            threading.Thread(target=handler, args=(s.accept()[0],), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return s.getsockname()[1]
print(json.dumps({"sink": serve(sink), "echo": serve(echo)}), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def servers():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ports = json.loads(proc.stdout.readline())
        yield {name: ("127.0.0.1", port) for name, port in ports.items()}
    finally:
        proc.stdin.close()
        proc.wait(10)


@pytest.fixture(autouse=True)
def _priority():
    """The test's endpoints run at the priority of the relay's pumps (nice -10 where
    allowed), as its servers do: on a machine shared with other jobs the scheduler
    then decides no figure, and the test measures the emulator."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, PUMP_NICE)
    yield
    os.setpriority(os.PRIO_PROCESS, tid, before)  # lowering a priority is always allowed


def _pings(sockets: list[socket.socket], n: int, pause_s: float) -> list[list[float]]:
    """RTTs of 64-byte ping-pongs, taking turns on each socket (3 unmeasured first: the
    far side's connect, first wake-ups), `pause_s` apart."""
    out: list[list[float]] = [[] for _ in sockets]
    for i in range(3 + n):
        for s, rtts in zip(sockets, out, strict=True):
            time.sleep(pause_s)
            t0 = time.perf_counter()
            s.sendall(b"p" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64 - got))
            if i >= 3:
                rtts.append(time.perf_counter() - t0)
    return out


def _connect(address) -> socket.socket:
    s = socket.create_connection(address, timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _rate(address, seconds: float) -> float:
    """bit/s of one connection sending for `seconds`, as its receiver saw it."""
    with socket.create_connection(address, timeout=30) as s:
        total, ns = send_until(s, b"x" * (1 << 20), time.monotonic() + seconds, STATS)
    return total * 8e9 / ns


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rtt_ms", [0.5, 1.0, 10.0])
def test_rtt_within_5_percent_or_0_2_ms(relay, servers, rtt_ms: float) -> None:
    spec = LinkSpec.symmetric(latency_s=rtt_ms / 2e3, bandwidth_bps=10 * GBIT)
    address = relay.add_link("ab", spec).add_forward(*servers["echo"])
    # Each ping through the link is paired with one to the same echo server without
    # it, as long idle before: the endpoints' own wake-ups (0.03 ms back to back,
    # 0.1-0.3 ms after 10 ms idle on a 2-core VM, more while other jobs run), which a
    # real WAN adds just the same. Paired, a burst of load hits both alike. Not
    # paired: the client's wake-up after blocking a whole round trip in recv (direct,
    # it blocks microseconds), 0.1-0.2 ms of what remains at 10 ms.
    fastest = math.inf

    def window() -> float:
        """The median of a window's pings through the link, less the endpoints'."""
        nonlocal fastest
        through, endpoints = _pings([linked, direct], 15 if rtt_ms < 5 else 8, spec.rtt_s)
        fastest = min(fastest, *through)
        return statistics.median(a - b for a, b in zip(through, endpoints, strict=True))

    # The bound on what the emulator adds, on a window's median: other jobs on
    # the machine delay single pings by milliseconds and, once in about ten runs while
    # other sessions' tests ran, most of a window's pings by ~0.5 ms (at a load of 12,
    # whole windows by 2-10 ms), so one of a few windows must meet it
    # (tests/sim/measured.py). Load can take this difference below the spec as well
    # (the direct pings delayed): the hard floor is checked on the raw pings below.
    with _connect(address) as linked, _connect(servers["echo"]) as direct:
        assert_delay(
            window,
            spec.rtt_s,
            max(0.05 * spec.rtt_s, 0.2e-3),
            hard_floor_s=-math.inf,
            what=f"RTT less the endpoints' at {rtt_ms} ms",
        )
    print(f"RTT spec {rtt_ms} ms: fastest {fastest * 1e3:.3f} ms")
    assert fastest >= spec.rtt_s - 20e-6  # never faster than light (timer: us)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rtt_ms", [100.0, 200.0])
def test_long_rtt_within_5_percent(relay, servers, rtt_ms: float) -> None:
    spec = LinkSpec.symmetric(latency_s=rtt_ms / 2e3, bandwidth_bps=10 * GBIT)
    with _connect(relay.add_link("ab", spec).add_forward(*servers["echo"])) as s:
        # Never 5 % faster; within 5 % in one of a few windows (tests/sim/measured.py).
        assert_delay(
            lambda: statistics.median(_pings([s], 7, 0.0)[0]),
            spec.rtt_s,
            0.05 * spec.rtt_s,
            what=f"RTT at {rtt_ms} ms",
        )


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("rtt_ms", "queue_bytes"),
    # A link asked for no queue at all keeps MIN_QUEUE_S of its rate: without it the
    # pump could admit a piece only once the one before had left the wire, and the
    # link idled between its turns (2.2-2.4 of 5 Gbit/s at queue 0 and 1 ms on the
    # 2-core VM, 2026-12-04).
    [(1.0, 1 << 20), (10.0, 1 << 20), (1.0, 0)],
    ids=["1ms", "10ms", "1ms-no-queue"],
)
def test_5_gbit_within_10_percent(relay, servers, rtt_ms: float, queue_bytes: int) -> None:
    spec = LinkSpec.symmetric(
        latency_s=rtt_ms / 2e3, bandwidth_bps=5 * GBIT, queue_bytes=queue_bytes
    )
    address = relay.add_link("ab", spec).add_forward(*servers["sink"])
    # What this machine carries now through the same relay, the same hops and the same
    # sink, on a link with the same latency and no rate limit: 8-10 Gbit/s on an idle
    # 2-core VM, 4-6 at a load of 10 (other jobs hold the cores). Shaping costs the
    # pumps some of it (pacing, the busy stretch before each release), so the spec is
    # owed only where the host carries 1.5x it unshaped, and otherwise two thirds of
    # what it carries; load changes within seconds, so the lesser of a probe before and
    # one after each attempt. Never above the spec + 3 % (timing noise) on any attempt,
    # whatever the load: a shaper that lets more through is wrong on any machine.
    free = relay.add_link(
        "free",
        LinkSpec.symmetric(
            latency_s=spec.a_to_b.latency_s, bandwidth_bps=100 * GBIT, queue_bytes=queue_bytes
        ),
    ).add_forward(*servers["sink"])
    ceiling = 5 * GBIT * 1.03
    seen: list[str] = []
    for _ in range(8):
        before = _rate(free, 0.2)
        rate = _rate(address, 0.4)
        capacity = min(before, _rate(free, 0.2))
        floor = 0.90 * min(5 * GBIT, capacity / 1.5)
        seen.append(f"{rate / GBIT:.2f} (floor {floor / GBIT:.2f} of {capacity / GBIT:.1f})")
        print(f"5 Gbit/s at {rtt_ms} ms: " + ", ".join(seen))
        assert rate <= ceiling, f"over the spec, which load cannot explain: {seen}"
        if rate >= floor:
            break
    else:
        pytest.fail(f"5 Gbit/s at {rtt_ms} ms short of what this host carries: {seen}")


@pytest.mark.timeout(60)
def test_bytes_in_flight_stay_bounded_at_5_gbit(relay) -> None:
    spec = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=5 * GBIT, queue_bytes=256 << 10)
    stalled = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        link = relay.add_link("ab", spec)
        with socket.create_connection(link.add_forward(*listener.getsockname())) as s:
            s.setblocking(False)
            sent, peak, last_progress = 0, 0, time.monotonic()
            while time.monotonic() - last_progress < 0.5 and sent < 1 << 30:
                try:
                    sent += s.send(b"x" * (1 << 20))
                    last_progress = time.monotonic()
                except BlockingIOError:
                    time.sleep(0.005)
                peak = max(peak, link.stats()["a_to_b"]["inflight_bytes"])
        limit = spec.a_to_b.inflight_limit_bytes  # 5 Gbit/s x (5 ms + 2 ms of queue) = 4.4 MB
        # Besides the link: the relay's window for a stalled receiver (limit + 256 KiB),
        # and kernel buffers: the relay's two sockets (1 MiB each way, doubled by
        # Linux), the receiver's and the sender's (autotuned, up to 4 MiB each).
        print(f"stalled receiver: sender got rid of {sent / 1e6:.1f} MB, peak in flight {peak}")
        assert peak <= limit + (1 << 20)  # an empty link admits one piece of <= 1 MiB
        assert sent < 2 * limit + (256 << 10) + (16 << 20), sent
    finally:
        stalled.set()
        listener.close()
        for conn in accepted:
            conn.close()


@pytest.mark.timeout(60)
def test_spliced_and_copied_pieces_keep_their_order(relay) -> None:
    # Corrupt(rate=0) reads every byte (the copying path) and changes none; switching
    # it on and off while a stream runs interleaves spliced and copied pieces.
    payload = os.urandom(48 << 20)
    got = bytearray()
    done = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def collect() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(1 << 20):
                got.extend(data)
        done.set()

    threading.Thread(target=collect, daemon=True).start()
    try:
        link = relay.add_link("ab", LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=4 * GBIT))
        with socket.create_connection(link.add_forward(*listener.getsockname())) as s:
            sender = threading.Thread(target=s.sendall, args=(payload,), daemon=True)
            sender.start()
            for i in range(20):
                link.set_impairments(a_to_b=(Corrupt(rate=0.0),) if i % 2 == 0 else ())
                time.sleep(0.01)
            sender.join(30)
            s.shutdown(socket.SHUT_WR)
            assert done.wait(30)
    finally:
        listener.close()
    assert len(got) == len(payload)
    assert got == payload
    # The pump counts a piece after its write returns: the receiver may be a moment ahead.
    wait_until(lambda: link.stats()["a_to_b"]["bytes_delivered"] >= len(payload), "count")
    assert link.stats()["a_to_b"]["bytes_delivered"] == len(payload)
