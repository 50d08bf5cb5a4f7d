"""The bulk transport: a lane's chunks on plain TCP, beside its gRPC service.

Why: python gRPC copies every received message about three times while it holds the
GIL (slice by slice into a bytearray, then into bytes) and once more on send; on a
16-core GPU host one lane topped out near 0.5 GB/s of tensor however little else it
did (docs/benchmarks.md, issue 11). Here a received chunk is read with ``recv_into``
straight into the buffer the round then sums from, and sent with one scatter-gather
``sendmsg``; both release the GIL for the whole copy.

The messages are the same ``PushChunksRequest`` encodings as on gRPC
(:mod:`isthmus.inter.wire`), validated by the same code (``LaneServer.accept``). On
one connection, for as many rounds as the lane lives:

* client -> server: ``MAGIC`` and a 32-byte ticket from the lane's ``OpenBulk`` RPC
  (that call is what the token authenticates; a ticket is single use and expires);
* server -> client: one byte, ``OK``;
* client -> server: frames, each a 12-byte record head (``u32`` length, ``u32``
  CRC-32C of the message, ``u32`` CRC-32C of those 8 bytes; little-endian) and the
  message. The message CRC covers the header fields too, which the payload's own
  checksum does not: a flipped step or chunk index would misfile a chunk;
* server -> client: one acknowledgement per frame, in order: ``ACCEPTED``, ``CORRUPT``
  (the payload failed its checksum: the round pulls it again with ``ResendChunk``),
  ``RESEND`` (the message failed the record's checksum: the client sends it again,
  on the same connection) or ``REFUSED`` + ``u8`` gRPC status code + ``u16`` length +
  UTF-8 reason, after which the server closes the connection, as a refused gRPC
  stream ends. A record head that fails its own checksum is refused (DATA_LOSS):
  the frame boundaries are lost.

Payloads cross in the clear: a lane with mutual TLS refuses ``OpenBulk`` and its
peers send on ``PushChunks`` inside TLS. Every read is bounded (frame length, hello
size, timeouts), so a silent or hostile peer costs one thread, never the job.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import grpc

from .codecs.base import crc32 as crc32c

__all__ = [
    "BulkConnection",
    "BulkError",
    "BulkListener",
    "BulkPeerRound",
    "BulkRefused",
    "Tickets",
    "record_head",
]

log = logging.getLogger(__name__)

MAGIC = b"ISTHBULK"
TICKET_BYTES = 32
TICKET_TTL_S = 60.0
HELLO_TIMEOUT_S = 10.0  # a connection that does not present its ticket in time is closed
_LINGER_S = 2.0  # how long a refusing server reads on so its refusal is not reset away
OK, ACCEPTED, CORRUPT, REFUSED, RESEND = 0, 1, 2, 3, 4
_HEAD = struct.Struct("<III")  # length, CRC-32C of the message, CRC-32C of the first 8 bytes
_REFUSAL = struct.Struct("<BH")  # gRPC status code value, reason length


class BulkError(ConnectionError):
    """The bulk connection broke or its peer broke the protocol."""


class BulkRefused(grpc.RpcError):
    """The peer refused a chunk (or the connection); reads like a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel: setting SO_RCVBUF turns its autotuning off
    # and is capped by net.core.rmem_max (often 208 KiB), which would cap a long link
    # at rmem_max / RTT (0.2 MiB over 10 ms: 170 Mbit/s per connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send_all(sock: socket.socket, parts: list[bytes]) -> None:
    """Writes ``parts`` in order with scatter-gather ``sendmsg``: no joined copy."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = sock.sendmsg(views)
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


def _read_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fills ``buf`` from ``sock``; raises BulkError if the peer closes first."""
    got, size = 0, len(buf)
    while got < size:
        n = sock.recv_into(buf[got:], size - got)
        if n == 0:
            raise BulkError("connection closed by the peer")
        got += n


class Tickets:
    """Single-use tickets for bulk connections, issued by ``OpenBulk``."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, limit: int = 256) -> None:
        self._lock = threading.Lock()
        self._live: dict[bytes, float] = {}
        self._ttl = ttl_s
        self._limit = limit

    def issue(self) -> bytes:
        ticket = os.urandom(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            self._live = {t: exp for t, exp in self._live.items() if exp > now}
            if len(self._live) >= self._limit:  # bounded: the oldest go first
                for t in sorted(self._live, key=self._live.get)[: len(self._live) // 2]:
                    del self._live[t]
            self._live[ticket] = now + self._ttl
        return ticket

    def redeem(self, ticket: bytes) -> bool:
        """True once for a live ticket (compared in constant time)."""
        now = time.monotonic()
        with self._lock:
            for t, expiry in list(self._live.items()):
                if hmac.compare_digest(t, ticket):
                    del self._live[t]
                    return expiry > now
        return False


Accept = Callable[[memoryview, str], tuple[int, grpc.StatusCode | None, str]]
"""The lane's judgement of one frame: (status, refusal code, reason)."""


class BulkListener:
    """The server side: a listening socket and a thread per connection.

    Args:
        host: interface to bind (the lane's).
        accept: judges and stores one frame (``LaneServer.accept_frame``).
        max_frame: the largest frame accepted, in bytes.
        where: who listens, for log lines.
    """

    def __init__(self, host: str, accept: Accept, max_frame: int, where: str) -> None:
        self.tickets = Tickets()
        self.corrupt_frames = 0
        """Frames that failed the record's checksum (each sent again by the peer)."""
        self._accept = accept
        self._max_frame = max_frame
        self._where = where
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._serve, name="lane-bulk", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._stopped.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._handle, args=(conn, addr), name="lane-bulk-rx", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            _tune(conn)
            conn.settimeout(HELLO_TIMEOUT_S)
            hello = bytearray(len(MAGIC) + TICKET_BYTES)
            _read_exact(conn, memoryview(hello))
            if hello[: len(MAGIC)] != MAGIC or not self.tickets.redeem(bytes(hello[len(MAGIC) :])):
                log.warning(
                    "%s: bulk connection from %s refused: no valid ticket", self._where, peer
                )
                self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "no valid bulk ticket")
                return
            conn.sendall(bytes([OK]))
            conn.settimeout(None)  # rounds may be minutes apart; the lane's stop closes it
            head = bytearray(_HEAD.size)
            while not self._stopped.is_set():
                _read_exact(conn, memoryview(head))
                size, frame_crc, head_crc = _HEAD.unpack(head)
                if crc32c(memoryview(head)[:8]) != head_crc:
                    why = "a frame's record head failed its checksum: frame boundaries lost"
                    log.warning("%s: bulk connection from %s: %s", self._where, peer, why)
                    self._refuse(conn, grpc.StatusCode.DATA_LOSS, why)
                    return
                if size > self._max_frame:
                    why = f"frame of {size} bytes exceeds {self._max_frame}"
                    log.warning("%s: bulk frame from %s refused: %s", self._where, peer, why)
                    self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, why)
                    return
                frame = bytearray(size)
                _read_exact(conn, memoryview(frame))
                if crc32c(frame) != frame_crc:
                    with self._lock:
                        self.corrupt_frames += 1
                    log.warning("%s: a bulk frame from %s failed its checksum", self._where, peer)
                    conn.sendall(bytes([RESEND]))
                    continue
                status, code, why = self._accept(memoryview(frame), peer)
                if status == REFUSED:
                    self._refuse(conn, code or grpc.StatusCode.INVALID_ARGUMENT, why)
                    return
                conn.sendall(bytes([status]))
        except (OSError, BulkError):
            pass  # the peer went away or the lane stops; its rounds see it on their side
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, why: str) -> None:
        """Sends the refusal, then closes without a reset: a close with unread data
        would send RST, and the peer could lose the refusal with the connection."""
        reason = why.encode("utf-8", errors="replace")[:1024]
        with contextlib.suppress(OSError):
            conn.sendall(bytes([REFUSED]) + _REFUSAL.pack(code.value[0], len(reason)) + reason)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            sink = bytearray(1 << 16)
            while time.monotonic() < deadline and conn.recv_into(sink):
                pass  # what the peer still had in flight, until it closes too

    def drop_connections(self) -> None:
        """Closes every open connection; the listener stays, and peers dial again."""
        self._close_connections()

    def stop(self) -> None:
        """Closes the listener and every connection."""
        self._stopped.set()
        self._sock.close()
        self._close_connections()

    def _close_connections(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


def _dial(host: str, port: int, proxy: str | None, timeout: float) -> socket.socket:
    """A TCP connection to host:port, through an HTTP CONNECT proxy if given."""
    if not proxy:
        return socket.create_connection((host, port), timeout=timeout)
    url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    sock = socket.create_connection((url.hostname, url.port or 80), timeout=timeout)
    try:
        target = f"{host}:{port}"
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(1024)
            if not data or len(reply) > 8192:
                raise BulkError(f"proxy {proxy} closed or sent junk for CONNECT {target}")
            reply += data
        status = reply.split(b"\r\n", 1)[0]
        if b" 200" not in status:
            raise BulkError(
                f"proxy {proxy} refused CONNECT {target}: {status.decode(errors='replace')}"
            )
        if not reply.endswith(b"\r\n\r\n"):
            raise BulkError(f"proxy {proxy} sent bytes after its CONNECT reply")
        return sock
    except BaseException:
        sock.close()
        raise


class BulkConnection:
    """One bulk connection to a peer's lane, shared by that peer's rounds.

    A sender thread writes queued frames in order; a reader thread matches each
    acknowledgement to the round that sent the frame. A broken connection fails
    the rounds with frames in flight; the next round dials again.

    Args:
        host: the peer lane's host.
        open_bulk: asks the peer's lane for (port, ticket) over gRPC, with a timeout.
        proxy: HTTP CONNECT proxy URL (the WAN emulator), or None.
        name: for thread names.
    """

    def __init__(
        self,
        host: str,
        open_bulk: Callable[[float], tuple[int, bytes]],
        proxy: str | None,
        name: str,
    ) -> None:
        self._host, self._open_bulk, self._proxy, self._name = host, open_bulk, proxy, name
        self._cond = threading.Condition()
        self._queue: deque[tuple[BulkPeerRound, bytes]] = deque()
        self._inflight: deque[tuple[BulkPeerRound, bytes]] = deque()
        self._sock: socket.socket | None = None
        self._closed = False
        self._dial_lock = threading.Lock()

    def put(self, rnd: BulkPeerRound, frame: bytes) -> None:
        with self._cond:
            if self._closed:
                raise BulkError("connection closed")
            self._queue.append((rnd, frame))
            self._cond.notify_all()
        self._ensure(rnd.deadline)

    def _ensure(self, deadline: float) -> None:
        """Dials (once) if there is no live connection; runs on the caller's thread."""
        with self._dial_lock:
            with self._cond:
                if self._sock is not None or self._closed:
                    return
                # Marked before the thread starts: it may connect (and set the socket)
                # before this line would otherwise run.
                self._sock = _PENDING
            threading.Thread(
                target=self._run, args=(deadline,), name=f"bulk-tx-{self._name}", daemon=True
            ).start()

    def _connect(self, deadline: float) -> socket.socket:
        # Like gRPC's wait_for_ready: a peer still starting is retried until the deadline.
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                port, ticket = self._open_bulk(max(0.001, min(left, 10.0)))
                sock = _dial(self._host, port, self._proxy, max(0.001, min(left, 10.0)))
                break
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if left <= delay:
                    raise
            except OSError:
                if left <= delay:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        try:
            _tune(sock)
            sock.settimeout(HELLO_TIMEOUT_S)
            sock.sendall(MAGIC + ticket)
            answer = bytearray(1)
            _read_exact(sock, memoryview(answer))
            if answer[0] != OK:
                raise _read_refusal(sock, answer[0])
            sock.settimeout(None)
            return sock
        except BaseException:
            sock.close()
            raise

    def _run(self, deadline: float) -> None:
        try:
            sock = self._connect(deadline)
        except BaseException as exc:  # noqa: BLE001 (handed to the rounds waiting)
            self._fail(exc, None, queued_too=True)  # nothing can be sent
            return
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._sock = sock
        reader = threading.Thread(
            target=self._read_acks, args=(sock,), name=f"bulk-ack-{self._name}", daemon=True
        )
        reader.start()
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed and self._sock is sock:
                        self._cond.wait(0.5)
                    if self._closed or self._sock is not sock:
                        return
                    idle = not self._inflight
                # A connection that sat idle may have been closed by the peer (a lane
                # restart, a middlebox): find out before a frame is lost in it.
                if idle and _peer_closed(sock):
                    self._fail(BulkError("the peer closed the idle connection"), sock)
                    return
                with self._cond:
                    rnd, frame = self._queue.popleft()
                    self._inflight.append((rnd, frame))
                _send_all(sock, [record_head(frame), frame])
        except OSError as exc:
            # The peer may have refused a frame and closed: its reason is what the
            # rounds should hear, so the reader gets a moment to read it first.
            reader.join(timeout=_LINGER_S)
            self._fail(BulkError(f"sending failed: {exc}"), sock)

    def _read_acks(self, sock: socket.socket) -> None:
        status = bytearray(1)
        try:
            while True:
                _read_exact(sock, memoryview(status))
                if status[0] == REFUSED:
                    raise _read_refusal(sock, status[0])
                if status[0] not in (ACCEPTED, CORRUPT, RESEND):
                    raise BulkError(f"unknown acknowledgement {status[0]}")
                with self._cond:
                    item = self._inflight.popleft() if self._inflight else None
                    if item is not None and status[0] == RESEND:
                        # Sent next; every frame already in flight is acknowledged
                        # before it, so the in-flight order stays the ack order.
                        self._queue.appendleft(item)
                        self._cond.notify_all()
                if item is None:
                    raise BulkError("acknowledgement for a frame never sent")
                item[0].acknowledged(status[0])
        except (OSError, BulkError, BulkRefused) as exc:
            self._fail(exc, sock)

    def _fail(
        self, exc: BaseException, sock: socket.socket | None, queued_too: bool = False
    ) -> None:
        """The connection is gone: rounds with frames in flight on it fail (those may
        or may not have arrived), and so do their queued frames; other rounds' queued
        frames were never sent and go out on a new connection."""
        with self._cond:
            if sock is not None and self._sock is not sock:
                return  # an older connection's late news
            failed = {id(r): r for r, _ in self._inflight}
            if queued_too:
                failed.update((id(r), r) for r, _ in self._queue)
            self._inflight.clear()
            self._queue = deque(item for item in self._queue if id(item[0]) not in failed)
            old, self._sock = self._sock, None
            redial = self._queue[0][0].deadline if self._queue and not self._closed else None
            self._cond.notify_all()
        if isinstance(old, socket.socket):
            old.close()
        for rnd in failed.values():
            rnd.failed(exc)
        if redial is not None:
            self._ensure(redial)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            sock, self._sock = self._sock, None
            self._cond.notify_all()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


_PENDING: socket.socket = object()  # type: ignore[assignment]  # dialling


def record_head(frame: bytes) -> bytes:
    """The 12 bytes that go before ``frame`` on a bulk connection (module docstring)."""
    first = struct.pack("<II", len(frame), crc32c(frame))
    return first + struct.pack("<I", crc32c(first))


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (a look at the receive queue, consuming nothing)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_refusal(sock: socket.socket, status: int) -> BulkRefused:
    if status != REFUSED:
        return BulkRefused(grpc.StatusCode.INTERNAL, f"unknown bulk status {status}")
    head = bytearray(_REFUSAL.size)
    try:
        _read_exact(sock, memoryview(head))
        code, size = _REFUSAL.unpack(head)
        reason = bytearray(size)
        _read_exact(sock, memoryview(reason))
    except (OSError, BulkError):
        return BulkRefused(grpc.StatusCode.UNAVAILABLE, "refused (reason cut off)")
    return BulkRefused(_CODES.get(code, grpc.StatusCode.UNKNOWN), reason.decode(errors="replace"))


class BulkPeerRound:
    """One round's chunks to one peer over its bulk connections (same interface as
    :class:`~isthmus.inter.lane_peer.PeerRound`)."""

    def __init__(self, conns: list[BulkConnection], deadline: float) -> None:
        self._conns = conns
        self.deadline = deadline
        self._cond = threading.Condition()
        self._next = 0
        self._ended = False
        self._error: BaseException | None = None
        self._taken = 0
        self.sent = 0
        self.resent = 0
        """Frames the peer received damaged and asked for again."""

    def send(self, frame: bytes) -> None:
        """Queues one serialized chunk; connections take turns. Thread-safe."""
        with self._cond:
            if self._ended or self._error is not None:
                return
            conn = self._conns[self._next]
            self._next = (self._next + 1) % len(self._conns)
            self.sent += 1
        try:
            conn.put(self, frame)
        except BulkError as exc:
            self.failed(exc)

    def end(self) -> None:
        """No more chunks in this round (later ones are dropped)."""
        with self._cond:
            self._ended = True

    def acknowledged(self, status: int) -> None:
        with self._cond:
            if status == RESEND:
                self.resent += 1  # the same frame goes again; one more ack to come
            else:
                self._taken += 1
            self._cond.notify_all()

    def failed(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def failure(self) -> BaseException | None:
        with self._cond:
            return self._error

    def wait(self, timeout: float) -> int:
        """Waits until the peer acknowledged every chunk; returns how many it took.

        Raises:
            BulkRefused: the peer refused a chunk; BulkError: the connection broke.
            TimeoutError: not all acknowledged within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._error is None and self._taken < self.sent:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self._taken} of {self.sent} chunks acknowledged")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            return self._taken
