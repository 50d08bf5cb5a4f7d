"""Loopback TCP endpoints for the emulator's tests (tests/sim/): a threaded server,
an echo handler, a byte sink that timestamps arrivals, and a timed send through a link.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from isthmus.sim import LinkSpec


class Server:
    """A threaded loopback TCP server; `serve(conn)` handles each connection."""

    def __init__(self, serve, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = self.sock.getsockname()
        self.conns: list[socket.socket] = []
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            # shutdown, not close: the handler thread owns the socket and closes it.
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def serve_echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def echo_noting_the_end(saw: list[str]):
    """A ``Server`` handler that echoes, then appends "eof" (an orderly end) or "reset"
    (RST) to ``saw``: how a test tells which end the relay gave the server."""

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1024):
                    conn.sendall(data)
                saw.append("eof")
            except ConnectionResetError:
                saw.append("reset")

    return serve


class Sink:
    """Counts bytes received on each connection and when they arrived."""

    def __init__(self) -> None:
        self.received = 0
        self.cond = threading.Condition()
        self.times: list[tuple[float, int]] = []  # (arrival time, total so far)

    def __call__(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 20):
                with self.cond:
                    self.received += len(data)
                    self.times.append((time.monotonic(), self.received))
                    self.cond.notify_all()

    def wait_for(self, total: int, timeout: float = 30) -> float:
        """Wait until `total` bytes arrived; return the arrival time of the last one."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.received >= total, timeout), self.received
            return next(t for t, n in self.times if n >= total)


@contextlib.contextmanager
def sink_server() -> Iterator[tuple[Sink, Server]]:
    """A Server whose connections a Sink reads, closed after."""
    sink = Sink()
    server = Server(sink)
    try:
        yield sink, server
    finally:
        server.close()


@contextlib.contextmanager
def noting_echo_link(relay, latency_s: float) -> Iterator[tuple[Any, tuple, list[str]]]:
    """A link of ``relay`` (``latency_s`` each way) to an echo server that notes how
    each connection ended (echo_noting_the_end): the link, the address of its forward
    and the server's notes. The server closes after."""
    saw: list[str] = []
    server = Server(echo_noting_the_end(saw))
    try:
        link = relay.add_link("ab", LinkSpec.symmetric(latency_s=latency_s))
        yield link, link.add_forward(*server.address), saw
    finally:
        server.close()


def connect(address) -> socket.socket:
    s = socket.create_connection(address, timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def send_timed(sock: socket.socket, sink: Sink, nbytes: int, latency_s: float) -> float:
    """Send `nbytes`; return goodput in bit/s over (first send -> last arrival - latency)."""
    start_total = sink.received
    chunk = b"x" * (1 << 20)
    t0 = time.monotonic()
    for _ in range(nbytes // len(chunk)):
        sock.sendall(chunk)
    t1 = sink.wait_for(start_total + nbytes)
    return nbytes * 8 / (t1 - t0 - latency_s)
