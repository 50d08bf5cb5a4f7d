"""The WAN emulator at line rate: throughput per link, many links, per-flow caps, RTT.

Runs `isthmus wan up` (user space only: no `ip`, no `tc`, no root) and measures, as
programs see it, through plain TCP forwards (`--forward`) and through the HTTP CONNECT
proxy:

- per-link throughput at each `--gbit` spec (0 = unlimited), with 1 and 4 links
  carrying at once (4 links of one `wan up` process, and 4 `wan up` processes of one
  link each: the pumps of one process share its interpreter);
- 1 and 8 flows on one link with a per-flow cap (`per_flow_mbit`), default 5 Gbit/s
  per flow on a 25 Gbit/s link: one flow should get the cap, 8 the link;
- round trips at each `--rtt-ms` spec, against the max(5 %, 0.2 ms) bound of issue 32.

Senders and sinks are processes of their own (one per flow; sinks pre-forked on one
listening socket), so the probe's interpreter does not bound what it measures. A rate
is bytes received over the span from the first flow's first byte to the last flow's
last byte (each flow's first read, which may hold a backlog, not counted). A first row
measures the machine without the emulator. The emulator's CPU use (its user + system
seconds over the transfer, in cores; and of its busiest thread, a pump, split into user
time, i.e. Python under the GIL, and system time, i.e. splice and loopback TCP) says
whether the emulator was the bottleneck, and which part of it.

    python3 benchmarks/wan_throughput.py                  # the full grid, ~2-3 minutes
    python3 benchmarks/wan_throughput.py --quick          # smoke test: 1 Gbit/s, 1 s

Prints a markdown table; writes JSON to `--json PATH` and/or `$OUT/wan_throughput.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wan_probe import ping_pong_ms, send_until  # the script's folder is on sys.path
from wan_up import Emulator

CHUNK = 4 << 20
STATS = struct.Struct("!QQQ")  # bytes after the first read, monotonic ns of its end, of the last
SINK_PROCESSES = 8
START_DELAY_S = 0.4  # flows connect, then all start sending at one monotonic time
_FORK = multiprocessing.get_context("fork")


# -- servers (forked processes) ----------------------------------------------------


def _sink_conn(conn: socket.socket) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, first, last = -1, 0, 0
    with conn:
        while n := conn.recv_into(view):
            last = time.monotonic_ns()
            if total < 0:
                first, total = last, 0
            else:
                total += n
        conn.sendall(STATS.pack(max(total, 0), first, last))


def _echo_conn(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _serve(listener: socket.socket, handler) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


def start_servers(kind: str, processes: int) -> tuple[int, list]:
    """A loopback listener served by `processes` forked processes; its port and them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    handler = _sink_conn if kind == "sink" else _echo_conn
    procs = [
        _FORK.Process(target=_serve, args=(listener, handler), daemon=True)
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    port = listener.getsockname()[1]
    listener.close()
    return port, procs


# -- clients -------------------------------------------------------------------------


def open_flow(address: tuple[str, int], via_proxy: str | None, target_port: int) -> socket.socket:
    """A connection to the target: directly or through a forward (`address`), or through
    a CONNECT proxy (`via_proxy` = "http://host:port") to 127.0.0.1:target_port."""
    if via_proxy is None:
        s = socket.create_connection(address, timeout=60)
    else:
        host, port = via_proxy.removeprefix("http://").rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(f"CONNECT 127.0.0.1:{target_port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = s.recv(4096)
            if not data:
                raise OSError("the proxy closed the connection")
            head += data
        status = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status:
            raise OSError(f"the proxy answered {status!r}")
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _send_flow(address, via_proxy, target_port, start_at, seconds, results) -> None:
    try:
        s = open_flow(address, via_proxy, target_port)
        payload = memoryview(bytearray(CHUNK))
        time.sleep(max(0.0, start_at - time.monotonic()))
        stats = send_until(s, payload, start_at + seconds, STATS)
        s.close()
        results.put(stats)
    except OSError as exc:
        results.put(str(exc))


def flows_rate(targets: list[tuple[Any, str | None]], sink_port: int, seconds: float) -> float:
    """Gbit/s of one flow per entry of `targets` ((address, proxy URL or None)), all at once."""
    results = _FORK.Queue()
    start_at = time.monotonic() + START_DELAY_S
    procs = [
        _FORK.Process(target=_send_flow, args=(a, p, sink_port, start_at, seconds, results))
        for a, p in targets
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(10)
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        raise RuntimeError(f"a flow failed: {errors[0]}")
    total = sum(g[0] for g in got)
    span_ns = max(g[2] for g in got) - min(g[1] for g in got)
    return total * 8 / span_ns if span_ns > 0 else 0.0


def rtt_ms(address, via_proxy: str | None, echo_port: int, pings: int) -> float:
    """Median ms of 64-byte ping-pongs (after 3 unmeasured ones)."""
    with open_flow(address, via_proxy, echo_port) as s:
        return ping_pong_ms(s, pings)


# -- the emulator --------------------------------------------------------------------


# -- the grid ------------------------------------------------------------------------

FOUR_LINKS = ["s0-s1", "s2-s3", "s0-s2", "s1-s3"]  # 4 distinct links of 4 sites


def _spec(gbit: float, cap_gbit: float = 0.0, rtt: float = 1.0) -> dict[str, float]:
    return {
        "bandwidth_mbit": gbit * 1000,
        "per_flow_mbit": cap_gbit * 1000,
        "latency_ms": rtt / 2,
        "queue_kib": 1024,
    }


def _measure(emulators, targets, sink_port, seconds) -> dict[str, float]:
    """One flow per target, all at once: Gbit/s summed, and the emulator's CPU in cores
    (all its threads; and the busiest thread, a pump: user = Python and the GIL,
    system = the kernel's splice and loopback TCP work). A thread near 1 core is the
    bottleneck."""
    before = {k: v for e in emulators for k, v in e.cpu_s().items()}
    t0 = time.monotonic()
    gbit = flows_rate(targets, sink_port, seconds)
    after = {k: v for e in emulators for k, v in e.cpu_s().items()}
    dt = time.monotonic() - t0
    used = {
        k: ((u - before.get(k, (0, 0))[0]) / dt, (st - before.get(k, (0, 0))[1]) / dt)
        for k, (u, st) in after.items()
    }
    user, system = max(used.values(), key=sum, default=(0.0, 0.0))
    return {
        "gbit": gbit,
        "emulator_cores": sum(map(sum, used.values())),
        "busiest_thread_user": user,
        "busiest_thread_system": system,
    }


def run(args: argparse.Namespace, report) -> None:
    sink_port, sinks = start_servers("sink", SINK_PROCESSES)
    echo_port, echoes = start_servers("echo", 1)
    local = ("127.0.0.1", sink_port)
    try:
        for flows in (1, 4):
            gbit = flows_rate([(local, None)] * flows, sink_port, args.seconds)
            report({"path": "direct", "links": 1, "flows": flows, "gbit": gbit})
        with tempfile.TemporaryDirectory() as tmp:
            one = Emulator(Path(tmp), 4, FOUR_LINKS, [sink_port, echo_port])
            singles = [Emulator(Path(tmp), 2, ["s0-s1"], [sink_port]) for _ in range(4)]
            try:
                _grid(args, report, one, singles, sink_port, echo_port)
            finally:
                for e in [one, *singles]:
                    e.close()
    finally:
        for p in sinks + echoes:
            p.kill()


def _grid(args, report, one: Emulator, singles: list[Emulator], sink_port, echo_port) -> None:
    paths = ("forward", "proxy")

    def target(e: Emulator, link: str, path: str):
        if path == "forward":
            return e.forwards[(link, sink_port)], None
        return None, e.proxies[link]

    for gbit in args.gbit:
        one.set(**_spec(gbit, rtt=args.rate_rtt_ms))
        for e in singles:
            e.set(**_spec(gbit, rtt=args.rate_rtt_ms))
        for path in paths:
            for links in (1, 4):
                targets = [target(one, link, path) for link in FOUR_LINKS[:links]]
                row = {"path": path, "links": links, "flows": links, "spec_gbit": gbit}
                report({**row, **_measure([one], targets, sink_port, args.seconds)})
        targets = [target(e, "s0-s1", "forward") for e in singles]
        row = {"path": "forward, 4 wan up", "links": 4, "flows": 4, "spec_gbit": gbit}
        report({**row, **_measure(singles, targets, sink_port, args.seconds)})

    one.set(**_spec(args.cap_link_gbit, args.cap_gbit, rtt=args.rate_rtt_ms))
    for path in paths:
        for flows in args.cap_flows:
            targets = [target(one, "s0-s1", path)] * flows
            row = {"path": path, "links": 1, "flows": flows, "spec_gbit": args.cap_link_gbit}
            row["cap_gbit"] = args.cap_gbit
            report({**row, **_measure([one], targets, sink_port, args.seconds)})

    for rtt in args.rtt_ms:
        one.set(**_spec(args.rtt_gbit, rtt=rtt))
        for path in paths:
            address = one.forwards[("s0-s1", echo_port)] if path == "forward" else None
            proxy = one.proxies["s0-s1"] if path == "proxy" else None
            measured = rtt_ms(address, proxy, echo_port, args.pings)
            within = abs(measured - rtt) <= max(0.05 * rtt, 0.2)
            row = {"path": path, "links": 1, "flows": 1, "spec_gbit": args.rtt_gbit}
            report({**row, "spec_rtt_ms": rtt, "rtt_ms": measured, "rtt_within": within})


# -- main ----------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _row_cells(row: dict[str, Any]) -> list[str]:
    spec = row.get("spec_gbit")
    spec_text = "-" if spec is None else f"{spec:g}" if spec else "unlimited"
    if row.get("cap_gbit"):
        spec_text += f", {row['cap_gbit']:g}/flow"
    if "rtt_ms" in row:
        rtt, want = row["rtt_ms"], row["spec_rtt_ms"]
        measured = f"RTT {rtt:.3f} ms of {want:g} ({rtt - want:+.3f} ms)"
        measured += "" if row["rtt_within"] else " outside max(5 %, 0.2 ms)"
        return [row["path"], "1", "1", spec_text, measured, "", "", ""]
    rate = row["gbit"]
    expect = spec if spec else None
    if row.get("cap_gbit") and row["flows"] == 1:
        expect = row["cap_gbit"]
    if expect:
        expect *= row["links"] if not row.get("cap_gbit") else 1
    vs = f"{(rate / expect - 1) * 100:+.0f}%" if expect else "-"
    per_link = f"{rate / row['links']:.2f}"
    cores = busiest = "-"
    if "emulator_cores" in row:
        cores = f"{row['emulator_cores']:.2f}"
        busiest = f"{row['busiest_thread_user']:.2f} + {row['busiest_thread_system']:.2f}"
    cells = [row["path"], str(row["links"]), str(row["flows"]), spec_text, per_link, vs]
    return [*cells, cores, busiest]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gbit", type=_floats, default=[10, 25, 50, 0], help="link specs, Gbit/s")
    parser.add_argument("--cap-link-gbit", type=float, default=25.0, help="link of the cap test")
    parser.add_argument("--cap-gbit", type=float, default=5.0, help="per-flow cap, Gbit/s")
    parser.add_argument("--cap-flows", type=_ints, default=[1, 8], help="flows in the cap test")
    parser.add_argument("--rate-rtt-ms", type=float, default=1.0, help="RTT of the rate tests")
    parser.add_argument("--rtt-ms", type=_floats, default=[1, 10, 50], help="RTT specs, ms")
    parser.add_argument("--rtt-gbit", type=float, default=10.0, help="link of the RTT tests")
    parser.add_argument("--seconds", type=float, default=2.0, help="sending time per rate")
    parser.add_argument("--pings", type=int, default=20, help="ping-pongs per RTT median")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 Gbit/s, 1 s")
    parser.add_argument("--json", type=Path, help="write the results here (also $OUT)")
    args = parser.parse_args()
    if args.quick:
        args.gbit, args.seconds, args.pings, args.rtt_ms = [1.0], 1.0, 8, [1, 10]
        args.cap_link_gbit, args.cap_gbit, args.rtt_gbit = 1.0, 0.2, 1.0
    rows: list[dict[str, Any]] = []
    head = ["path", "links", "flows", "spec Gbit/s", "Gbit/s per link", "vs spec"]
    head += ["wan up cores", "busiest thread user + sys"]
    print("| " + " | ".join(head) + " |\n" + "| --- " * len(head) + "|", flush=True)

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print("| " + " | ".join(_row_cells(row)) + " |", flush=True)

    t_start = time.monotonic()
    run(args, report)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "seconds": round(time.monotonic() - t_start, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": rows,
    }
    print(f"{result['seconds']} s on {result['machine']}")
    paths = [args.json] if args.json else []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "wan_throughput.json")
    for path in paths:
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
