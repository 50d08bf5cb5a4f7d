"""`isthmus probe serve`: answers pings, sinks bulk flows and measures another server on
a peer's request, bounded in time and connections (the wire: probe.py)."""

from __future__ import annotations

import hmac
import json
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from isthmus.deploy.launch.probe import (
    CHUNK,
    ECHO,
    HEAD,
    IO_TIMEOUT_S,
    MAGIC,
    MAX_PINGERS,
    MAX_SECONDS,
    PROBE,
    SINK,
    STATUS,
    ProbeError,
    measure_link,
    recv_exact,
    send_blob,
)

MAX_CONNECTIONS = 512  # the most a server serves at once (pings use up to MAX_PINGERS)


class _Handler(socketserver.BaseRequestHandler):
    server: ProbeServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.server.slots.acquire(blocking=False):
            return self._answer(1, "busy: too many probe connections")
        try:
            self._serve(sock)
        except (OSError, ValueError, TypeError, ConnectionError):
            pass  # a client that left or sent garbage: nothing to keep
        finally:
            self.server.slots.release()

    def _answer(self, status: int, message: str = "") -> None:
        raw = message.encode()
        self.request.sendall(MAGIC + STATUS.pack(status, len(raw)) + raw)

    def _serve(self, sock: socket.socket) -> None:
        if recv_exact(sock, len(MAGIC)) != MAGIC:
            return self._answer(1, "not an isthmus probe request (or another version)")
        op, token_len, params_len = HEAD.unpack(recv_exact(sock, HEAD.size))
        token = recv_exact(sock, token_len) if token_len <= 4096 else b""
        params = json.loads(recv_exact(sock, params_len)) if params_len <= 65536 else None
        if not hmac.compare_digest(token, self.server.token):
            return self._answer(1, "refused: wrong or missing job token")
        if op not in (ECHO, SINK, PROBE) or not isinstance(params, dict):
            return self._answer(1, f"unknown probe op {op!r}")
        self._answer(0)
        end = time.monotonic() + MAX_SECONDS * 2  # no client holds a server longer
        if op == ECHO:
            self.server.echo(sock.dup(), end)  # this thread's copy closes as it returns
        elif op == SINK:
            send_blob(sock, _sink(sock, min(MAX_SECONDS, float(params.get("seconds", 1)))))
            while time.monotonic() < end and sock.recv(CHUNK):  # until the sender leaves
                pass
        else:
            send_blob(sock, self.server.probe_for_peer(params))


def _sink(sock: socket.socket, seconds: float) -> dict[str, float]:
    """Read for ``seconds`` from the first byte; the rate over their second half, measured
    here, at the receiver (the first half holds TCP's slow start). Stopping here, not at
    the sender, leaves no sender's buffer to drain at the link's rate."""
    buf = bytearray(CHUNK)
    times, totals, total = [], [], 0
    while n := sock.recv_into(buf):
        total += n
        times.append(time.monotonic())
        totals.append(total)
        if times[-1] - times[0] >= seconds:
            break
    if len(times) < 2:
        return {"bytes": total, "bps": 0.0}
    half = times[0] + (times[-1] - times[0]) / 2
    i = next(k for k, t in enumerate(times) if t >= half)
    span = times[-1] - times[i]
    return {"bytes": total, "bps": (totals[-1] - totals[i]) * 8 / span if span > 0 else 0.0}


class ProbeServer(socketserver.ThreadingTCPServer):
    """`isthmus probe serve`: echoes pings, sinks bulk data, and probes another server on
    a peer's request (so one command measures every pair of a job's sites)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = MAX_PINGERS  # the pingers connect at once

    def __init__(
        self,
        address: tuple[str, int],
        token: bytes = b"",
        audit: Callable[[dict[str, Any]], list[dict[str, str]]] | None = None,
    ) -> None:
        super().__init__(address, _Handler)
        self.token = token
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._audit = audit
        self._probing = threading.Lock()  # one probe run on a peer's behalf at a time
        # One thread answers every ping: a thread each would wait its turn for the GIL,
        # and a ping late for that would read as a loss.
        self._pings = selectors.DefaultSelector()
        threading.Thread(target=self._echo_forever, name="probe-echo", daemon=True).start()

    def echo(self, sock: socket.socket, end: float) -> None:
        if len(self._pings.get_map()) >= MAX_CONNECTIONS:  # past its handler: count here
            sock.close()
            return
        self._pings.register(sock, selectors.EVENT_READ, end)

    def shutdown_request(self, request) -> None:  # socketserver's request type, unannotated
        self.close_request(request)  # without socketserver's SHUT_WR: an echo's copy lives on

    def _echo_forever(self) -> None:
        while True:
            for key, _ in self._pings.select(timeout=1.0):
                sock = cast(socket.socket, key.fileobj)
                try:
                    if time.monotonic() < key.data and (data := sock.recv(4096)):
                        sock.sendall(data)
                        continue
                except OSError:
                    pass
                self._pings.unregister(sock)
                sock.close()

    def probe_for_peer(self, params: dict[str, Any]) -> dict[str, Any]:
        if not self._probing.acquire(blocking=False):
            return {"error": "busy: already probing"}
        try:
            link = measure_link(
                str(params.get("target")),
                flows=int(params.get("flows", 8)),
                seconds=float(params.get("seconds", 3)),
                token=self.token,
            )
            if self._audit is not None:
                link["audit"] = self._audit(link)
            return link
        except (ValueError, ProbeError, OSError) as exc:
            return {"error": str(exc)}
        finally:
            self._probing.release()
