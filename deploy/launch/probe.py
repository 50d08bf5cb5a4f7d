"""`isthmus probe`'s measurement: the wire both ends speak and the client that measures
a link's RTT, loss, 1-flow and N-flow throughput over plain TCP against a probe server
(probe_server.py; docs/wan.md, "Probe a link before the job").

Every connection opens with a header (MAGIC, an op, the optional job token, JSON
parameters) and the server answers MAGIC and a status before anything else, so a probe
pointed at another service fails in one line and a stray client gets nothing."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import select
import selectors
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from isthmus.inter.tcp_info import read_tcp_info

MAGIC = b"isthmus-probe\x01"  # the last byte is the protocol's version
HEAD = struct.Struct("!cHI")  # op, token bytes, parameter bytes
STATUS = struct.Struct("!BH")  # 0 = ok, else refused; message bytes
LENGTH = struct.Struct("!I")
ECHO, SINK, PROBE = b"E", b"S", b"P"
MAX_SECONDS = 60.0  # the longest phase a server runs for anyone
MAX_PINGERS = 256
PING_RATE = 2500.0
"""Round trips a second the loss phase aims at, over as many connections as that takes
(each one ping in flight): enough for a loss estimate in seconds at 50 ms, few enough
for Python and the emulator on 2 cores (at 4,000 its pings queued up and read late)."""
CAP_RATIO = 1.3
"""N flows carrying this many times one flow's rate mean the link (or a host) caps a
flow: the 1-flow figure is the cap. Below it one flow already fills the link."""
LATE_S = 2e-3  # a ping this much late is a loss: above a busy host's jitter
IO_TIMEOUT_S = 10.0
CHUNK = 1 << 20


class ProbeError(RuntimeError):
    """What went wrong reaching or reading a probe server, in one line."""


def parse_address(text: str) -> tuple[str, int]:
    """ "HOST:PORT" (IPv6 in brackets) as (host, port); ValueError in one line."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("connection closed")
        data += got
    return bytes(data)


def send_blob(sock: socket.socket, value: Any) -> None:
    raw = json.dumps(value).encode()
    sock.sendall(LENGTH.pack(len(raw)) + raw)


def recv_blob(sock: socket.socket) -> Any:
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    return json.loads(recv_exact(sock, n))


def open_op(
    target: str, op: bytes, token: bytes = b"", params: dict[str, Any] | None = None
) -> socket.socket:
    """A connection to the probe server at ``target`` that accepted ``op``."""
    host, port = parse_address(target)
    try:
        sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
    except OSError as exc:
        raise ProbeError(
            f"cannot reach a probe server at {target}: {exc.strerror or exc}"
        ) from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw = json.dumps(params or {}).encode()
    not_probe = f"{target} is not an isthmus probe server (`isthmus probe serve`)"
    try:
        sock.sendall(MAGIC + HEAD.pack(op, len(token), len(raw)) + token + raw)
        magic = recv_exact(sock, len(MAGIC))
        status, n = STATUS.unpack(recv_exact(sock, STATUS.size))
        message = recv_exact(sock, n if magic == MAGIC else 0).decode(errors="replace")
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise ProbeError(f"{not_probe}: {exc}") from None
    if magic != MAGIC or status:
        sock.close()
        raise ProbeError(not_probe if magic != MAGIC else f"{target}: {message}")
    return sock


def open_ops(
    target: str, op: bytes, token: bytes, n: int, params: dict[str, Any] | None = None
) -> list[socket.socket]:
    """``n`` connections of ``op``, opened at once: one after another would take n
    round trips (13 s for 256 pingers at 50 ms)."""
    with ThreadPoolExecutor(max_workers=min(n, 64)) as pool:
        futures = [pool.submit(open_op, target, op, token, params) for _ in range(n)]
    socks = [f.result() for f in futures if f.exception() is None]
    if len(socks) < n:
        for s in socks:
            s.close()
        raise next(exc for f in futures if (exc := f.exception()) is not None)
    return socks


def _ping_rtts(
    target: str, token: bytes, seconds: float, pingers: int, spread: float = 0.0
) -> tuple[list, float]:
    """(when it came back, round trip) in seconds of each 8-byte ping, one at a time on
    each of ``pingers`` connections for ``seconds``; the pings' share retransmitted.
    The connections start evenly over ``spread`` s: started at once, their pings would
    travel as one burst for good, and the burst's last ones come back late."""
    socks = open_ops(target, ECHO, token, pingers)
    sel = selectors.DefaultSelector()
    sent: dict[socket.socket, float] = {}
    rtts: list[tuple[float, float]] = []
    try:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        first = time.perf_counter()
        end, started = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            now = time.perf_counter()
            while started < pingers and first + spread * started / pingers <= now:
                sent[socks[started]] = now
                socks[started].send(b"isthmus!")
                started += 1
            wait = first + spread * started / pingers - now if started < pingers else 1.0
            for key, _ in sel.select(timeout=max(0.0, wait)):
                s = cast(socket.socket, key.fileobj)
                if len(s.recv(64)) != 8:  # 8 bytes a ping; another count is a stall's split
                    raise ProbeError(f"{target}: a ping came back wrong")
                now = time.perf_counter()
                rtts.append((now, now - sent[s]))
                sent[s] = now
                s.send(b"isthmus!")
        infos = [i for s in socks if (i := read_tcp_info(s)) is not None]
        out = sum(i.segs_out for i in infos)
        return rtts, sum(i.total_retrans for i in infos) / out if out else 0.0
    finally:
        sel.close()
        for s in socks:
            s.close()


def rtt_and_loss(target: str, token: bytes, seconds: float) -> tuple[float, float, int]:
    """The median RTT (s), the one-way loss estimate and the pings it rests on.

    A ping whose segment (or its echo's) is lost comes back at least a retransmission
    late: an RTT (the emulator's stall) or more (a lone segment's tail-loss probe, 10 ms
    or more, or timeout on a real link). So the share ``f`` of round trips later than
    the median by half of it (at least LATE_S) is the chance either direction lost one,
    and the one-way loss is 1 - sqrt(1 - f). A late ping among many late ones (over a
    quarter of those back within half an RTT of it) was held up by a busy host, not a
    loss, and is left out. The pings' own retransmits (TCP_INFO) count on a real link;
    the larger estimate wins. Limits: the emulator's stalls are seen from 2 x LATE_S RTT
    on; jitter beyond the threshold reads as loss; a loss rate p needs ~100 / p pings
    for 10 % (PING_RATE)."""
    # The RTT from one connection: many at once queue behind each other in this process.
    first, _ = _ping_rtts(target, token, min(2.0, max(0.5, seconds / 4)), 1)
    if not first:
        raise ProbeError(f"{target}: no ping came back in {seconds:g} s")
    median = statistics.median(r for _, r in first)
    pingers = max(4, min(MAX_PINGERS, round(PING_RATE * median)))
    pings, retrans = _ping_rtts(target, token, seconds, pingers, spread=median)
    back = [t for t, _ in pings]
    late = [r > median + max(median / 2, LATE_S) for _, r in pings]
    before = [0, *itertools.accumulate(late)]  # late pings before each index
    lost = 0
    for i, t in enumerate(back):
        lo, hi = bisect.bisect_left(back, t - median / 2), bisect.bisect_right(back, t + median / 2)
        lost += late[i] and before[hi] - before[lo] <= max(1, (hi - lo) // 4)
    counted = len(pings) - (sum(late) - lost)
    return median, max(1 - (1 - lost / max(1, counted)) ** 0.5, retrans), counted


def bulk(target: str, token: bytes, flows: int, seconds: float) -> dict[str, Any]:
    """``flows`` connections sending for ``seconds`` at once; their summed rate as the
    server received it, and what the kernel says of the sending side."""
    socks = open_ops(target, SINK, token, flows, {"seconds": seconds})
    payload = memoryview(bytes(CHUNK // 4))
    results: list[dict[str, Any]] = [{} for _ in socks]
    end = time.monotonic() + seconds + IO_TIMEOUT_S

    def send(k: int) -> None:
        s = socks[k]
        try:  # until the server answers: it stops the clock
            while not select.select([s], [], [], 0)[0]:
                if time.monotonic() > end:
                    raise ConnectionError(f"no answer after {seconds:g} s of data")
                s.sendall(payload)
            info = read_tcp_info(s)
            results[k] = {**recv_blob(s), "info": info}
        except (OSError, ConnectionError, ValueError) as exc:
            results[k] = {"error": str(exc)}
        # Load on until every flow is measured: one that stopped early would give the
        # others' last moments a share of the link they never had together.
        with contextlib.suppress(OSError):
            while not all(results) and time.monotonic() < end:
                s.sendall(payload)

    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(flows)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in socks:
            s.close()
    if failed := [r["error"] for r in results if "error" in r]:
        raise ProbeError(f"{target}: a bulk flow failed: {failed[0]}")
    infos = [r["info"] for r in results if r["info"] is not None]
    out = sum(i.segs_out for i in infos)
    return {
        "gbit": sum(r["bps"] for r in results) / 1e9,
        "retrans_ratio": sum(i.total_retrans for i in infos) / out if out else 0.0,
        "mtu": infos[0].pmtu_bytes if infos else None,
        "mss": infos[0].mss_bytes if infos else None,
        "congestion": infos[0].congestion if infos else None,
    }


def measure_link(
    target: str,
    *,
    flows: int = 8,
    seconds: float = 3.0,
    token: bytes = b"",
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Probe the link from here to the probe server at ``target`` (HOST:PORT): the
    RTT and loss from pings, the rate of 1 flow and of ``flows``, and the per-flow cap
    that implies (None when one flow already fills the link). Raises ProbeError."""
    if not 1 <= flows <= 64 or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"need 1..64 flows and 0..{MAX_SECONDS:g} s, got {flows} and {seconds}")
    progress(f"{target}: pings for {seconds:g} s")
    rtt, loss, pings = rtt_and_loss(target, token, seconds)
    progress(f"{target}: RTT {rtt * 1e3:.2f} ms; 1 flow for {seconds:g} s")
    one = bulk(target, token, 1, seconds)
    progress(f"{target}: 1 flow {one['gbit']:.3f} Gbit/s; {flows} flows for {seconds:g} s")
    many = bulk(target, token, flows, seconds)
    capped = many["gbit"] > CAP_RATIO * one["gbit"]
    return {
        "target": target,
        "rtt_ms": rtt * 1e3,
        "gbit_1flow": one["gbit"],
        "gbit_nflows": many["gbit"],
        "per_flow_cap_gbit": one["gbit"] if capped else None,
        "loss": loss,
        "retrans_ratio": many["retrans_ratio"],
        "mtu": one["mtu"],
        "mss": one["mss"],
        "congestion": one["congestion"],
        "flows": flows,
        "seconds": seconds,
        "pings": pings,
    }


def probe_pair(
    server: str, target: str, *, flows: int, seconds: float, token: bytes = b""
) -> dict[str, Any]:
    """Ask the probe server at ``server`` to probe ``target`` from where it is."""
    sock = open_op(server, PROBE, token, {"target": target, "flows": flows, "seconds": seconds})
    try:
        sock.settimeout(IO_TIMEOUT_S * 2 + 4 * seconds)
        result = recv_blob(sock)
    except (OSError, ConnectionError, ValueError) as exc:
        raise ProbeError(f"{server}: no result probing {target}: {exc}") from None
    finally:
        sock.close()
    if "error" in result:
        raise ProbeError(f"{server} probing {target}: {result['error']}")
    return result
