"""What each step of one chunk's life in a lane costs, alone and from many threads.

A lane moves a chunk through a fixed series of steps (encode and copy to the host,
checksum, socket, copy to the device and decode, sum and encode of the result). This
times each step on its own, from one thread (its latency) and from ``--threads``
threads at once (its throughput when the lane's pool runs it concurrently), so the step
that bounds a lane shows without a profiler. ``--retain N`` keeps each thread's last N results alive, as a
lane's outbox keeps a step's payloads; every thread makes its first N before the clock
starts, so the table is of warm steps (a lane's first steps also pay for allocating
what it keeps: docs/benchmarks/lanes.md, "Warm lanes"). Prints a table, writes JSON:

    python3 benchmarks/chunk_costs.py --device cuda --mib 16 --threads 1,4,8 --json costs.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np
import torch

from isthmus.inter.data.codecs.chain import crc32, make_codec
from isthmus.inter.data.round.device import on_lane_stream, sum_parts
from isthmus.inter.data.transport.bulk_stream import empty

MIB = 1 << 20


def _on_stream(buffer: torch.Tensor, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` as a round's task runs: on a GPU on this thread's lane stream, waited for."""

    def run() -> object:
        with on_lane_stream(buffer):
            return fn()

    return run


def _socket_step(size: int) -> tuple[Callable[[], object], Callable[[], None]]:
    """One payload over a loopback TCP connection into a fresh buffer, per call
    (a connection per thread, as a lane's bulk connections)."""
    local = threading.local()
    conns: list[socket.socket] = []
    lock = threading.Lock()
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    def pair() -> tuple[socket.socket, socket.socket]:
        listener = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        listener.close()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MIB)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)
        with lock:
            conns.extend((a, b))
        return a, b

    def step() -> object:
        if not hasattr(local, "pair"):
            local.pair = pair()
        a, b = local.pair
        sender = threading.Thread(target=a.sendall, args=(data,))
        sender.start()
        buf = empty(size)
        view, got = memoryview(buf), 0
        while got < size:
            got += b.recv_into(view[got:])
        sender.join()
        return buf

    def close() -> None:
        for s in conns:
            s.close()

    return step, close


def _steps(device: torch.device | None, mib: float, codec_name: str) -> dict:
    n = int(mib * MIB) // 4
    codec = make_codec(codec_name)
    dev = device or torch.device("cpu")
    grad = torch.randn(n, device=dev)
    payload = codec.encode(grad, None)
    payload_bytes = bytes(payload)
    other = torch.randn(n, device=dev)
    local = threading.local()  # each thread sums into its own buffer, as chunks do
    keys = iter(range(1 << 30))

    def out() -> torch.Tensor:
        if not hasattr(local, "out"):
            local.out = torch.empty(n, device=dev)
        return local.out

    def encode() -> object:
        return codec.encode(grad, f"k{next(keys) % 64}", require_finite=True)

    def decode() -> object:
        if device is None:
            return codec.decode_array(payload_bytes, n)
        return codec.decode_device(payload_bytes, n, device)

    def summed(part: object) -> torch.Tensor:
        if device is None:  # a CPU round sums numpy arrays
            return torch.from_numpy(sum_parts({0: grad.numpy(), 1: part}, out().numpy(), 2, False))
        return sum_parts({0: grad, 1: part}, out(), 2, False)

    def reduce() -> object:
        total = summed(other if device is not None else other.numpy())
        return codec.encode(total, f"r{next(keys) % 64}", require_finite=True, decoded_out=total)

    def decode_reduce() -> object:  # a contribution received, summed, its result encoded
        total = summed(decode())
        return codec.encode(total, f"r{next(keys) % 64}", require_finite=True, decoded_out=total)

    sock, close = _socket_step(len(payload_bytes))
    return {
        "payload_bytes": len(payload_bytes),
        "close": close,
        "steps": {
            "encode+host copy": _on_stream(grad, encode),
            "crc32c": lambda: crc32(payload_bytes),
            "socket (loopback)": sock,
            "to device+decode": _on_stream(grad, decode),
            "sum+encode result": _on_stream(grad, reduce),
            "decode+sum+encode": _on_stream(grad, decode_reduce),
        },
    }


def _time(fn: Callable[[], object], threads: int, seconds: float, retain: int) -> tuple[float, int]:
    """(calls a second over all threads, calls), each thread calling ``fn`` in a loop
    and keeping its last ``retain`` results alive (a lane's outbox keeps a round's
    payloads until every peer took them)."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    limit = [math.inf]  # set once every thread is warm

    def loop(i: int) -> None:
        kept: collections.deque = collections.deque(maxlen=max(1, retain))
        for _ in range(max(1, retain)):  # warm: streams, kernels, the payloads kept
            kept.append(fn())
        start.wait()
        while time.perf_counter() < limit[0]:
            kept.append(fn())
            counts[i] += 1

    with futures.ThreadPoolExecutor(threads) as pool:
        done = pool.map(loop, range(threads))
        start.wait()
        t0 = time.perf_counter()
        limit[0] = t0 + seconds
        list(done)
    return sum(counts) / (time.perf_counter() - t0), sum(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mib", type=float, default=16.0, help="fp32 MiB per chunk")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=2.0, help="per step and thread count")
    parser.add_argument("--retain", type=int, default=0, help="results each thread keeps alive")
    parser.add_argument("--only", default="", help="steps to time, comma-separated names")
    parser.add_argument("--json", default="chunk-costs.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if args.device == "cuda" else None
    plan = _steps(device, args.mib, args.codec)
    counts = [int(t) for t in args.threads.split(",")]
    rows = []
    try:
        for name, fn in plan["steps"].items():
            if args.only and name not in args.only.split(","):
                continue
            for threads in counts:
                rate, calls = _time(fn, threads, args.seconds, args.retain)
                rows.append({
                    "step": name, "threads": threads, "calls": calls,
                    "ms_per_call": 1e3 * threads / rate if rate else float("inf"),
                    "gb_s_fp32": rate * args.mib * MIB / 1e9,
                })  # fmt: skip
    finally:
        plan["close"]()
    print(f"{args.codec} chunks of {args.mib:g} MiB fp32 ({plan['payload_bytes']} payload "
          f"bytes) on {args.device}")  # fmt: skip
    print(f"{'step':<22} {'threads':>7} {'ms/call':>9} {'GB/s fp32':>10}")
    for r in rows:
        print(f"{r['step']:<22} {r['threads']:>7} {r['ms_per_call']:>9.3f} {r['gb_s_fp32']:>10.2f}")
    with open(args.json, "w") as f:
        json.dump({"device": args.device, "mib": args.mib, "codec": args.codec,
                   "retain": args.retain, "rows": rows}, f,
                  indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
