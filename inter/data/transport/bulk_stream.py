"""One bulk connection's bytes: plain TCP, or the same framing inside mutual TLS.

The bulk protocol (:mod:`.bulk`) runs on a :class:`PlainStream` (a TCP socket:
scatter-gather ``sendmsg``, payloads read and checksummed in one C call that holds no
GIL, :mod:`.wirecore`) or on a :class:`TlsStream` (Python's ``ssl``, TLS 1.3, both sides
presenting a certificate of the job CA), which offer the same few calls.

Why TLS here and not gRPC's: a lane inside gRPC's TLS moved ~0.5 GB/s of tensor on a
GPU host, the bulk port 3.2 (docs/benchmarks/lanes.md); gRPC copies each message several
times under the GIL, while ``SSLSocket.send`` and ``recv_into`` encrypt and decrypt
with the GIL released, straight from and into the round's buffers.

OpenSSL's ``SSL`` objects must not be used by two threads at once, and the sending
side has two: one writes frames, one reads their acknowledgements. So a TlsStream's
socket is non-blocking and every TLS call runs under the stream's lock, which is
never held while waiting: a thread whose call would block releases it and polls
the socket. A sender stuck on a full send buffer thus never keeps the reader from
an acknowledgement, nor from noticing a stalled flow. One exception: the listener's
payload read (:meth:`TlsStream.recv_payload`) keeps the lock through its waits, since
the listener's thread is the connection's only user there; ``close`` shuts the
socket first, which ends such a wait.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

from isthmus.inter.data.codecs.base import crc32 as crc32c
from isthmus.inter.data.transport import wirecore
from isthmus.inter.data.transport.wirecore import FrameClosed
from isthmus.inter.security import TLS_NAME, SiteSecurity

__all__ = [
    "PlainStream",
    "Stream",
    "TlsStream",
    "client_context",
    "empty",
    "server_context",
    "shut",
    "tune",
]

USER_TIMEOUT_S = 30.0
"""A bulk connection whose sent bytes go unacknowledged this long is dropped by the
kernel (``TCP_USER_TIMEOUT``), and one idle that long is probed (keepalive): a peer
that vanished (a host down, a cable cut) fails the connection, not a thread forever."""
SLICE_BYTES = 1 << 20
"""Bytes of a payload per TLS write: the lock is free between slices, so the
acknowledgement reader never waits longer than one slice's encryption for it."""
_POLL_S = 0.5  # a wait wakes this often to see whether its stream was closed


def tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel: setting SO_RCVBUF turns its autotuning off
    # and is capped by net.core.rmem_max (often 208 KiB), which would cap a long link
    # at rmem_max / RTT (0.2 MiB over 10 ms: 170 Mbit/s per connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(USER_TIMEOUT_S * 1000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, int(USER_TIMEOUT_S))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def empty(size: int) -> memoryview:
    """``size`` writable bytes, not zeroed: every byte is received before it is read.
    (Pinned memory here, for a CUDA round to copy from without a staging copy, was
    measured slower: 1.4-1.5 GB/s of raw CUDA rounds against 1.7-1.8, 2026-11-29.)"""
    array = np.empty(size, dtype=np.uint8)
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12.
    return memoryview(array).cast("B")  # type: ignore[arg-type]


class PlainStream:
    """A bulk connection on plain TCP."""

    tls = False
    peer_names: frozenset[str] = frozenset()

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> None:  # a few bytes: an acknowledgement, a hello
        self.sock.sendall(data)

    def send_parts(self, parts: list[bytes | memoryview]) -> None:
        """Writes ``parts`` in order with scatter-gather ``sendmsg``: no joined copy."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            n = self.sock.sendmsg(views)
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0] = views[0][n:]
                    n = 0

    def read_exact(self, buf: memoryview, timeout: float | None = None) -> None:
        """Fills ``buf``; TimeoutError after ``timeout`` s without a byte (None: never),
        FrameClosed if the peer closes first (both streams)."""
        self.sock.settimeout(timeout)
        wirecore.read_exact(self.sock, buf)

    def recv_payload(self, buf: memoryview, stall_s: float, f32: bool) -> tuple[int, bool | None]:
        """Fills ``buf`` and checksums it as it comes (:func:`wirecore.recv_payload`)."""
        return wirecore.recv_payload(self.sock, buf, stall_s, f32)

    def wait_readable(self, timeout: float) -> bool:
        return _poll_in(self.sock.fileno(), timeout)

    def idle_closed(self) -> bool:
        """Whether the peer closed this connection while nothing was owed to us (a look
        at the receive queue, consuming nothing)."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def refuse(self, message: bytes, linger_s: float) -> None:
        """Sends ``message`` and closes without a reset: a close with unread data would
        send RST, and the peer could lose the message with the connection."""
        with contextlib.suppress(OSError):
            self.sock.sendall(message)
            self.sock.shutdown(socket.SHUT_WR)
            _drain(self.sock.recv_into, self.sock, linger_s)

    def shutdown(self) -> None:
        """Wakes every thread waiting on this connection; ``close`` still follows."""
        shut(self.sock)

    def close(self) -> None:
        self.sock.close()


class TlsStream:
    """A bulk connection inside mutual TLS (module docstring: one lock, no wait held),
    made by :meth:`handshake`."""

    tls = True

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._closed = False
        self.peer_names = _names(sock.getpeercert() or {})
        """The DNS names in the peer's certificate (its site's name, and TLS_NAME)."""

    @staticmethod
    def wrap(sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> ssl.SSLSocket:
        """``sock`` as a TLS socket before its handshake (which takes its descriptor). The
        listener is checked against :data:`TLS_NAME`, as gRPC's channels check a server."""
        return context.wrap_socket(
            sock,
            server_side=server_side,
            server_hostname=None if server_side else TLS_NAME,
            do_handshake_on_connect=False,
        )

    @classmethod
    def handshake(cls, tls: ssl.SSLSocket, timeout: float) -> TlsStream:
        """Runs the TLS handshake of a :meth:`wrap` socket within ``timeout`` s; raises
        ssl.SSLError (a certificate refused, on either side) or OSError, and closes it."""
        try:
            tls.settimeout(timeout)
            tls.do_handshake()
            tls.setblocking(False)
            return cls(tls)
        except BaseException:
            tls.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def _call(self, op: Callable[..., int], *args: object) -> tuple[int, int]:
        """Runs one TLS call under the lock: (its result, 0), or (0, the poll events to
        wait for) when it would block."""
        with self._lock:
            if self._closed:
                raise OSError("bulk connection closed")
            try:
                return op(*args), 0
            except ssl.SSLWantReadError:
                return 0, select.POLLIN
            except ssl.SSLWantWriteError:
                return 0, select.POLLOUT

    def _wait(self, events: int, deadline: float) -> None:
        """Polls for ``events`` until ``deadline`` (then TimeoutError), the lock free."""
        while True:
            if self._closed:
                raise OSError("bulk connection closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no progress on the bulk connection")
            poller = select.poll()
            poller.register(self.sock.fileno(), events | select.POLLERR | select.POLLHUP)
            if poller.poll(math.ceil(min(left, _POLL_S) * 1000)):
                return

    def send(self, data: bytes) -> None:
        """Writes a few bytes (an acknowledgement, a hello) as one TLS record."""
        self.send_parts([data, b""])

    def send_parts(self, parts: list[bytes | memoryview]) -> None:
        """Writes ``parts`` in order: the record head and header joined into one TLS
        record, the payload straight from where it lies, in :data:`SLICE_BYTES` slices."""
        *small, payload = parts
        for view in (memoryview(b"".join(small)), memoryview(payload).cast("B")):
            for at in range(0, len(view), SLICE_BYTES):
                piece = view[at : at + SLICE_BYTES]
                # A write that would block is made again with the same bytes (OpenSSL's
                # rule). No deadline here: a stalled flow is found by the reader of
                # acknowledgements, whose shutdown ends this wait.
                while want := self._call(self.sock.send, piece)[1]:
                    self._wait(want, math.inf)

    def read_exact(self, buf: memoryview, timeout: float | None = None) -> None:
        view = memoryview(buf).cast("B")
        got, size = 0, len(view)
        while got < size:
            n, want = self._call(self.sock.recv_into, view[got:], size - got)
            if want:
                self._wait(want, math.inf if timeout is None else time.monotonic() + timeout)
            elif n == 0:
                raise FrameClosed("connection closed by the peer")
            else:
                got += n

    def recv_payload(self, buf: memoryview, stall_s: float, f32: bool) -> tuple[int, bool | None]:
        """Fills ``buf``, then checksums it (and checks fp32 words for NaN/Inf), in Python:
        ``ssl`` offers C code no hold of its TLS object. The lock once a payload, not once
        a 16 KiB record: 0.50-0.55 GB/s against 0.42-0.43 on a 16-core H100."""
        view = memoryview(buf).cast("B")
        got, size = 0, len(view)
        with self._lock:
            while got < size:
                if self._closed:
                    raise OSError("bulk connection closed")
                try:
                    n = self.sock.recv_into(view[got:], size - got)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as exc:
                    read = isinstance(exc, ssl.SSLWantReadError)
                    self._wait(
                        select.POLLIN if read else select.POLLOUT, time.monotonic() + stall_s
                    )
                    continue
                if n == 0:
                    raise FrameClosed("connection closed by the peer")
                got += n
        crc = crc32c(buf)
        if not f32:
            return crc, None
        if len(buf) % 4:
            return crc, False  # not whole fp32 words: refused by the lane's checks
        return crc, wirecore.all_finite(np.frombuffer(buf, dtype=np.float32))

    def wait_readable(self, timeout: float) -> bool:
        """Whether a byte can be read within ``timeout`` seconds (bytes already inside
        the TLS object count: the socket alone would not show them)."""
        with self._lock:
            if not self._closed and self.sock.pending():
                return True
        return _poll_in(self.sock.fileno(), timeout)

    def idle_closed(self) -> bool:
        """Whether the peer closed this connection while nothing was owed to us: any
        byte then is its closing alert (a listener sends nothing unasked, not even
        session tickets: :func:`server_context`)."""
        with self._lock:
            if self._closed or self.sock.pending():
                return True
            try:
                # The socket's own bytes: socket.socket's recv, not the TLS one.
                socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                return True
            return True

    def refuse(self, message: bytes, linger_s: float) -> None:
        """Sends ``message`` inside TLS and closes the way :meth:`PlainStream.refuse` does."""
        with contextlib.suppress(OSError, TimeoutError):
            deadline = time.monotonic() + linger_s
            while want := self._call(self.sock.send, message)[1]:
                self._wait(want, deadline)
            with self._lock:
                socket.socket.shutdown(self.sock, socket.SHUT_WR)
            raw = functools.partial(socket.socket.recv_into, self.sock)
            _drain(raw, self.sock, max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        """Wakes every thread waiting on this connection; ``close`` still follows. The
        TLS object is left alone (another thread may be inside a call of it): the
        socket under it is shut, and every call after fails."""
        shut(self.sock)

    def close(self) -> None:
        self.shutdown()
        with self._lock:
            self._closed = True
            self.sock.close()


Stream = PlainStream | TlsStream


def shut(sock: socket.socket) -> None:
    """Shuts ``sock`` both ways, waking its waiting threads; for a TLS socket the one
    under the TLS object (``SSLSocket.shutdown`` would drop the TLS object under a
    thread still using it)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _poll_in(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(math.ceil(max(0.0, timeout) * 1000)))


def _drain(recv_into: Callable[[bytearray], int], sock: socket.socket, linger_s: float) -> None:
    """Reads what the peer still had in flight, for ``linger_s`` or until it closes."""
    deadline = time.monotonic() + linger_s
    sink = bytearray(1 << 16)
    with contextlib.suppress(OSError):
        while (left := deadline - time.monotonic()) > 0:
            if _poll_in(sock.fileno(), left) and not recv_into(sink):
                return


def _names(cert: dict) -> frozenset[str]:
    return frozenset(v for k, v in cert.get("subjectAltName", ()) if k == "DNS")


@functools.lru_cache(maxsize=8)
def _context(ca: bytes, cert: bytes, key: bytes, server_side: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED  # both ways: mutual TLS, as on the gRPC port
    context.load_verify_locations(cadata=ca.decode("ascii"))
    # ssl loads a key only from a file: a private one (mkstemp's 0600), gone once read.
    fd, path = tempfile.mkstemp(prefix="isthmus-bulk-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(cert.rstrip(b"\n") + b"\n" + key)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    if server_side:
        # Nothing unasked after the handshake: the sending side takes any byte on an
        # idle connection for the listener's closing alert (TlsStream.idle_closed).
        context.num_tickets = 0
    return context


def server_context(security: SiteSecurity, server_side: bool = True) -> ssl.SSLContext | None:
    """The bulk listener's TLS context (client certificates of the job CA required), or
    with ``server_side`` False the sending side's (presents the site's certificate,
    checks the listener's against the job CA and :data:`TLS_NAME`); None without TLS."""
    if not security.require_tls:
        return None
    assert security.ca and security.cert and security.key  # SiteSecurity checks
    return _context(security.ca, security.cert, security.key, server_side)


def client_context(security: SiteSecurity) -> ssl.SSLContext | None:
    return server_context(security, server_side=False)
