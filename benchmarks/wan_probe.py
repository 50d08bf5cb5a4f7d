"""Probe the WAN emulator from outside: throughput and RTT against the spec, over a grid.

Starts `isthmus wan up` (one link, a plain TCP forward and the HTTP CONNECT proxy) and a
server process (TCP sink, TCP echo, gRPC sink and echo), then for every pair of
bandwidth and RTT of the grid changes the link live (`wan set`'s control endpoint) and
measures, as a program would see it:

- TCP Gbit/s: one connection sends for `--seconds`; the sink reports bytes over the
  time from its first to its last byte (the steady rate, without the one-way delay).
- TCP RTT: median of `--pings` 64-byte ping-pongs on one connection.
- gRPC Gbit/s and RTT: the same through the proxy, with a client-streaming call of
  4 MiB messages and unary empty calls.

A row "direct" measures the same without the emulator: the probe's own limit on this
machine (a spec above it cannot be met by any emulator here).

    python3 benchmarks/wan_probe.py [--gbit 1,10,25] [--rtt-ms 0.5,1,10,100] [--json out.json]

Needs only the isthmus package (and grpcio, which it depends on). Default grid: about
two minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

from wan_up import Emulator  # the script's folder is on sys.path

LINK = "s0-s1"  # the one link, site s0 to site s1

CHUNK = 1 << 20
GRPC_MESSAGE = 4 << 20
STATS = struct.Struct("!QQ")  # bytes after the first read, ns from its end to the last
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


# -- the server process ---------------------------------------------------------------


def _sink(conn: socket.socket) -> None:
    buf = bytearray(CHUNK)
    total, first, last = -1, 0, 0
    with conn:
        while n := conn.recv_into(buf):
            last = time.perf_counter_ns()
            if total < 0:  # count from the end of the first read: it may hold a backlog
                first, total = last, 0
            else:
                total += n
        conn.sendall(STATS.pack(max(total, 0), last - first))


def _echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _serve_tcp(handler) -> int:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


def _grpc_sink(requests, context) -> bytes:
    total, first, last = -1, 0, 0
    for message in requests:
        last = time.perf_counter_ns()
        if total < 0:
            first, total = last, 0
        else:
            total += len(message)
    return STATS.pack(max(total, 0), last - first)


def serve(with_grpc: bool) -> None:
    """Run the servers; print their ports as one JSON line; exit when stdin closes."""
    ports = {"sink": _serve_tcp(_sink), "echo": _serve_tcp(_echo)}
    if not with_grpc:
        print(json.dumps(ports), flush=True)
        sys.stdin.read()
        return
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
        "Sink": grpc.stream_unary_rpc_method_handler(_grpc_sink),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.P", handlers),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports["grpc"] = grpc_port
    print(json.dumps(ports), flush=True)
    sys.stdin.read()
    server.stop(None)


# -- the client side ------------------------------------------------------------------


def send_until(s: socket.socket, payload: bytes | memoryview, end: float, stats: struct.Struct):
    """Sends ``payload`` again and again until monotonic ``end``, then half-closes: the
    receiver's answer, read whole and unpacked with ``stats``."""
    while time.monotonic() < end:
        s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    answer = b""
    while len(answer) < stats.size and (data := s.recv(stats.size)):
        answer += data
    return stats.unpack(answer)


def tcp_rate(address: tuple[str, int], seconds: float) -> float:
    """Gbit/s of one connection sending for `seconds`, as its receiver saw it."""
    with socket.create_connection(address, timeout=60) as s:
        total, ns = send_until(s, b"x" * CHUNK, time.monotonic() + seconds, STATS)
    return total * 8 / ns if ns else 0.0


def tcp_rtt(address: tuple[str, int], pings: int) -> float:
    """Median ms of 64-byte ping-pongs (after 3 unmeasured ones)."""
    with socket.create_connection(address, timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return ping_pong_ms(s, pings)


def ping_pong_ms(s: socket.socket, pings: int) -> float:
    """Median ms of 64-byte ping-pongs on a connected socket to an echo server (after
    3 unmeasured ones)."""
    payload, rtts = b"p" * 64, []
    for i in range(3 + pings):
        t0 = time.perf_counter()
        s.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(s.recv(len(payload) - got))
        if i >= 3:
            rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) * 1e3


def grpc_channel(port: int, proxy: str | None) -> Any:
    import grpc

    options = list(GRPC_OPTIONS)
    if proxy is not None:
        options += [("grpc.enable_http_proxy", 1), ("grpc.http_proxy", proxy)]
    else:
        options += [("grpc.enable_http_proxy", 0)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def grpc_rate(channel: Any, seconds: float) -> float:
    payload = b"g" * GRPC_MESSAGE
    end = time.monotonic() + seconds

    def messages():
        while time.monotonic() < end:
            yield payload

    total, ns = STATS.unpack(channel.stream_unary("/probe.P/Sink")(messages(), timeout=120))
    return total * 8 / ns if ns else 0.0


def grpc_rtt(channel: Any, pings: int) -> float:
    echo, rtts = channel.unary_unary("/probe.P/Echo"), []
    for i in range(3 + pings):
        t0 = time.perf_counter()
        echo(b"p", timeout=60)
        if i >= 3:
            rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) * 1e3


def measure(args, tcp_sink, tcp_echo, grpc_port, proxy) -> dict[str, float]:
    row = {
        "tcp_gbit": tcp_rate(tcp_sink, args.seconds),
        "tcp_rtt_ms": tcp_rtt(tcp_echo, args.pings),
    }
    if not args.no_grpc:
        with grpc_channel(grpc_port, proxy) as channel:
            row["grpc_rtt_ms"] = grpc_rtt(channel, args.pings)
            row["grpc_gbit"] = grpc_rate(channel, args.seconds)
    return row


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _cell(value: float | None, spec: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if not spec:
        return f"{value:.{digits}g}"
    return f"{value:.{digits}g} ({(value / spec - 1) * 100:+.0f}%)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gbit", type=_floats, default=[1, 10, 25], help="bandwidths, Gbit/s (0: unlimited)"
    )
    parser.add_argument("--rtt-ms", type=_floats, default=[0.5, 1, 10, 100], help="RTTs, ms")
    parser.add_argument("--seconds", type=float, default=1.0, help="sending time per rate")
    parser.add_argument("--pings", type=int, default=15, help="ping-pongs per RTT median")
    parser.add_argument("--no-grpc", action="store_true", help="plain TCP only")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(with_grpc=not args.no_grpc)
        return 0
    # no_proxy must not bypass the proxy (see sim/relay.py); gRPC reads the lower case.
    os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112
    serve_cmd = [sys.executable, __file__, "--serve", *(["--no-grpc"] if args.no_grpc else [])]
    server = subprocess.Popen(serve_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdout is not None
    ports = json.loads(server.stdout.readline())
    rows = []
    header = "| spec Gbit/s | spec RTT ms | TCP Gbit/s | TCP RTT ms | gRPC Gbit/s | gRPC RTT ms |"
    print(header + "\n" + "| --- " * 6 + "|", flush=True)

    def report(row: dict) -> None:
        rows.append(row)
        gbit, rtt = row.get("spec_gbit"), row.get("spec_rtt_ms")
        cells = [
            "direct" if gbit is None else f"{gbit:g}" if gbit else "unlimited",
            "-" if rtt is None else f"{rtt:g}",
            _cell(row.get("tcp_gbit"), gbit),
            _cell(row.get("tcp_rtt_ms"), rtt, 4),
            _cell(row.get("grpc_gbit"), gbit),
            _cell(row.get("grpc_rtt_ms"), rtt, 4),
        ]
        print("| " + " | ".join(cells) + " |", flush=True)

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        local = ("127.0.0.1",)
        report(
            measure(args, (*local, ports["sink"]), (*local, ports["echo"]), ports.get("grpc"), None)
        )
        emulator = Emulator(Path(tmp), 2, [LINK], list(ports.values()))
        try:
            for gbit in args.gbit:
                for rtt_ms in args.rtt_ms:
                    set_s = emulator.set(
                        bandwidth_mbit=gbit * 1000, latency_ms=rtt_ms / 2, queue_kib=1024
                    )
                    row = measure(
                        args,
                        emulator.forwards[(LINK, ports["sink"])],
                        emulator.forwards[(LINK, ports["echo"])],
                        ports.get("grpc"),
                        emulator.proxies[LINK],
                    )
                    report({"spec_gbit": gbit, "spec_rtt_ms": rtt_ms, "set_s": set_s, **row})
        finally:
            emulator.close()
            server.communicate(b"", timeout=10)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "seconds": round(time.monotonic() - t_start, 1),
        "rows": rows,
    }
    print(f"{result['seconds']} s on {result['machine']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
