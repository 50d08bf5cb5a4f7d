"""The bulk transport: a lane's chunks on plain TCP, beside its gRPC service.

Why: python gRPC copies a received message about three times under the GIL, which held
one lane near 0.5 GB/s (docs/benchmarks/lanes.md); here a chunk is read with ``recv_into``
straight into the round's buffer and sent with one ``sendmsg``, the GIL released for both.
The messages are ``PushChunksRequest`` encodings (:mod:`.wire`) judged by the same code
as on gRPC (``LaneServer.take``). On one connection, for as many rounds as the lane lives:

* client -> server: ``MAGIC`` and a 32-byte ticket that the lane granted the client's
  site (``OpenBulk`` asks; ``GrantBulk`` hands it to the asking site's own lane, so a
  stranger who asks gets none); a ticket is single use, expires, and names the site
  whose chunks the connection may carry;
* server -> client: one byte, ``OK``;
* client -> server: frames, each a 16-byte record head (``u32`` header length,
  ``u32`` payload length, ``u32`` CRC-32C of the header, ``u32`` CRC-32C of those 12
  bytes; little-endian), the header (a ``PushChunksRequest`` with every field but the
  payload) and the payload's bytes. The payload is covered by its own checksum, in
  the header; the record's covers the header (a flipped step or chunk index would
  misfile a chunk). So each byte is checksummed once, and the receiver reads the
  payload straight into the round's buffer, checksumming it as it comes (:mod:`.wirecore`);
* server -> client: one acknowledgement per frame, in order: ``ACCEPTED``, ``CORRUPT``
  (the payload failed its checksum: the round pulls it again with ``ResendChunk``),
  ``RESEND`` (the header failed the record's checksum: the client sends it again,
  on the same connection) or ``REFUSED`` + ``u8`` gRPC status code + ``u16`` length +
  UTF-8 reason, after which the server closes the connection, as a refused gRPC
  stream ends. A record head that fails its own checksum is refused (DATA_LOSS):
  the frame boundaries are lost.

The sending side is :mod:`.bulk_peer`. With mutual TLS all of this runs inside TLS 1.3
(:mod:`.bulk_stream`, docs/wire.md). Every read is bounded (frame length, hello size,
timeouts), so a silent or hostile peer costs one thread, never the job.
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.data.codecs.base import crc32 as crc32c
from isthmus.inter.data.transport.bulk_stream import (
    PlainStream,
    Stream,
    TlsStream,
    empty,
    shut,
    tune,
)
from isthmus.inter.data.transport.chunk_size import PER_SITE_CONNECTIONS
from isthmus.inter.data.transport.wire import Chunk, Frame, WireError, parse_header
from isthmus.inter.data.transport.wirecore import FrameClosed

__all__ = ["BulkError", "BulkListener", "BulkRefused", "Tickets", "frame_bytes", "record_head"]


MAGIC = b"ISTHBLK2"  # the second version of the framing (header and payload apart)
TICKET_BYTES = 32
TICKET_TTL_S = 60.0
HELLO_TIMEOUT_S = 10.0  # a connection that does not present its ticket in time is closed
FRAME_STALL_S = 30.0
"""A frame whose bytes stop for this long closes its connection (400 frames left open once
held 450 MB and 400 threads); between frames a connection may idle for minutes."""
MAX_UNTICKETED = 16
"""Connections without a ticket yet, at once; the next closes the oldest (600 once took 516
threads and the listener's descriptors). A real peer presents its ticket within
milliseconds, so a flood only replaces itself."""
LINGER_S = 2.0  # how long a refusing server reads on so its refusal is not reset away
OK, ACCEPTED, CORRUPT, REFUSED, RESEND = 0, 1, 2, 3, 4
_MAGIC_V1 = b"ISTHBULK"  # one message with one checksum over all of it; refused by name
MAX_HEADER = 4096  # bytes of a frame's header: its fields are a few numbers and a codec name
_HEAD = struct.Struct("<IIII")  # header length, payload length, CRC-32C of the header, of 12 bytes
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


def read_exact(stream: Stream, buf: memoryview, timeout: float | None = None) -> None:
    """Fills ``buf`` from ``stream``; raises BulkError if the peer closes first,
    TimeoutError after ``timeout`` s without a byte (None: never)."""
    try:
        stream.read_exact(buf, timeout)
    except FrameClosed as exc:
        raise BulkError(str(exc)) from None


class Tickets:
    """Tickets for bulk connections, each bound to the site it was granted to (only that
    site's own lane is handed one: ``GrantBulk``). A bulk connection redeems one, once,
    and its chunks must come from that site; a ``PushChunks`` stream may present one as
    a pass until it expires (lanes without TLS or a bulk port)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, limit: int = 256) -> None:
        self._lock = threading.Lock()
        self.live: dict[bytes, tuple[float, str]] = {}
        self._ttl = ttl_s
        self._limit = limit

    def issue(self, holder: str) -> bytes:
        """A new ticket for ``holder`` (a site's name, or its index as a string)."""
        ticket = os.urandom(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            self.live = {t: v for t, v in self.live.items() if v[0] > now}
            if len(self.live) >= self._limit:  # bounded: the oldest go first
                for t in sorted(self.live, key=self.live.__getitem__)[: len(self.live) // 2]:
                    del self.live[t]
            self.live[ticket] = (now + self._ttl, holder)
        return ticket

    def cancel(self, ticket: bytes) -> None:
        with self._lock:
            self.live.pop(ticket, None)

    def redeem(self, ticket: bytes) -> str | None:
        """The holder of a live ticket, once (compared in constant time); else None."""
        return self._find(ticket, use=True)

    def holder(self, ticket: bytes) -> str | None:
        """The holder of a live ticket, which stays live (a pass); else None."""
        return self._find(ticket, use=False)

    def _find(self, ticket: bytes, use: bool) -> str | None:
        now = time.monotonic()
        with self._lock:
            for t, (expiry, holder) in list(self.live.items()):
                if hmac.compare_digest(t, ticket):
                    if use or expiry <= now:
                        del self.live[t]
                    return holder if expiry > now else None
        return None


Accept = Callable[[Chunk, str, str], tuple[int, grpc.StatusCode | None, str]]
"""The lane's judgement of one received chunk from (caller's address, ticket's holder):
(status, refusal code, reason)."""


class BulkListener:
    """The server side: a listening socket and a thread per connection. ``accept`` judges
    and stores one chunk (``LaneServer.take``); ``tls`` runs every connection inside
    mutual TLS, where with ``vouch`` a certificate's DNS names must name the ticket's
    holder."""

    def __init__(
        self,
        host: str,
        accept: Accept,
        max_frame: int,
        where: str,
        refusals: RefusalLog | None = None,
        tickets: Tickets | None = None,
        tls: ssl.SSLContext | None = None,
        vouch: Callable[[str, frozenset[str]], bool] | None = None,
    ) -> None:
        self.tickets = tickets or Tickets()
        self._tls = tls
        self._vouch = vouch if tls is not None else None
        self.refusals = refusals or RefusalLog(where)  # once per caller and reason a minute
        self._waiting: dict[socket.socket, str] = {}  # no ticket yet, oldest first
        self._held: Counter[str] = Counter()  # ticketed connections open, per site
        self.corrupt_frames = 0  # frames that failed the record's checksum (each sent again)
        self._accept = accept
        self._max_frame = max_frame
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.conns: set[socket.socket] = set()  # open now, under _lock
        self._thread = threading.Thread(target=self._serve, name="lane-bulk", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, addr = self._sock.accept()
                if self._tls is not None:  # no I/O yet: the handshake is the thread's
                    try:
                        conn = TlsStream.wrap(conn, self._tls, server_side=True)
                    except BaseException:
                        conn.close()
                        raise
            except OSError as exc:
                if self._stopped.is_set():
                    return  # closed by stop()
                # Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the listener
                # lives on; connections that end free what it needs.
                self.refusals.note("the listener", "accept failed", str(exc))
                self._stopped.wait(0.1)
                continue
            with self._lock:
                if self._stopped.is_set():
                    conn.close()
                    return
                self.conns.add(conn)
                oldest = None
                if len(self._waiting) >= MAX_UNTICKETED:
                    oldest = next(iter(self._waiting))
                    who = self._waiting.pop(oldest)
                self._waiting[conn] = _peer(addr)
            if oldest is not None:
                self.refusals.note(
                    who, f"bulk connection closed: {MAX_UNTICKETED} newer ones wait for a ticket"
                )
                shut(oldest)  # its thread ends and closes it
            threading.Thread(
                target=self._handle, args=(conn, addr), name="lane-bulk-rx", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, addr: tuple) -> None:
        peer = _peer(addr)
        held: str | None = None  # the site whose connection this is, once counted
        stream: Stream = PlainStream(conn)
        try:
            try:
                tune(conn)
                if self._tls is not None:
                    tls = self._handshake(conn, peer)
                    if tls is None:
                        return
                    stream = tls
                hello = bytearray(len(MAGIC) + TICKET_BYTES)
                read_exact(stream, memoryview(hello), HELLO_TIMEOUT_S)
            finally:
                with self._lock:
                    self._waiting.pop(conn, None)
            ticket = bytes(hello[len(MAGIC) :])
            holder = self.tickets.redeem(ticket) if hello[: len(MAGIC)] == MAGIC else None
            if hello[: len(MAGIC)] == _MAGIC_V1:
                why = "bulk framing version 1; this lane speaks version 2: upgrade that site"
                self.refusals.note(peer, f"bulk connection refused: {why}")
                self._refuse(stream, grpc.StatusCode.FAILED_PRECONDITION, why)
                return
            if holder is None:
                self.refusals.note(peer, "bulk connection refused: no valid ticket")
                self._refuse(stream, grpc.StatusCode.UNAUTHENTICATED, "no valid bulk ticket")
                return
            if self._vouch is not None and not self._vouch(holder, stream.peer_names):
                # A ticket is the site's; under TLS its certificate must say so too.
                why = f"a ticket of site {holder[:64]!r} on a certificate that does not name it"
                self.refusals.note(peer, f"bulk connection refused: {why}")
                self._refuse(stream, grpc.StatusCode.PERMISSION_DENIED, why)
                return
            if not self._hold(holder):
                why = (
                    f"site {holder[:64]!r} holds {PER_SITE_CONNECTIONS} bulk connections "
                    "already (twice the most sync.connections opens)"
                )
                self.refusals.note(peer, f"bulk connection refused: {why}")
                self._refuse(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                return
            held = holder
            stream.send(bytes([OK]))
            head = bytearray(_HEAD.size)
            while not self._stopped.is_set():
                # Rounds may be minutes apart (the lane's stop closes the connection);
                # a frame begun comes on, or is given up.
                read_exact(stream, memoryview(head)[:1], None)
                read_exact(stream, memoryview(head)[1:], FRAME_STALL_S)
                if not self._frame(stream, head, peer, holder):
                    return
        except TimeoutError:
            why = (
                f"a frame stalled {FRAME_STALL_S:.0f}s"
                if held
                else f"no ticket within {HELLO_TIMEOUT_S:.0f}s"
            )
            self.refusals.note(peer, f"bulk connection closed: {why}")
        except (OSError, BulkError):
            pass  # the peer went away or the lane stops; its rounds see it on their side
        finally:
            with self._lock:
                if held is not None:
                    self._held[held] -= 1
                self.conns.discard(conn)
                self._waiting.pop(conn, None)
            stream.close()

    def _hold(self, holder: str) -> bool:
        """Counts one more connection of ``holder``; False if it holds its most."""
        with self._lock:
            if self._held[holder] >= PER_SITE_CONNECTIONS:
                return False
            self._held[holder] += 1
            return True

    def _handshake(self, conn: socket.socket, peer: str) -> TlsStream | None:
        """Mutual TLS on an accepted connection; None (logged once per peer) when the
        peer's certificate, or its lack of one, is refused."""
        assert isinstance(conn, ssl.SSLSocket)
        try:
            return TlsStream.handshake(conn, HELLO_TIMEOUT_S)
        except ssl.SSLError as exc:
            # The kind is the SSL reason (no certificate, unknown CA, not TLS at all...);
            # the message, which names a line of CPython's _ssl.c, is the detail.
            why = f"bulk connection refused: TLS handshake failed ({exc.reason})"
            self.refusals.note(peer, why, str(exc))
            return None

    def _frame(self, stream: Stream, head: bytearray, peer: str, holder: str) -> bool:
        """Reads the frame whose record head is ``head`` and answers it; False once the
        connection was refused (and is to be closed)."""
        header_size, payload_size, header_crc, head_crc = _HEAD.unpack(head)
        if crc32c(memoryview(head)[:12]) != head_crc:
            why = "a frame's record head failed its checksum: frame boundaries lost"
            self.refusals.note(peer, f"bulk connection refused: {why}")
            self._refuse(stream, grpc.StatusCode.DATA_LOSS, why)
            return False
        if header_size > MAX_HEADER or payload_size > self._max_frame:
            why = (
                f"frame of {header_size} + {payload_size} bytes exceeds "
                f"{MAX_HEADER} + {self._max_frame}"
            )
            self.refusals.note(peer, f"bulk frame refused: {why}")
            self._refuse(stream, grpc.StatusCode.INVALID_ARGUMENT, why)
            return False
        header = bytearray(header_size)
        read_exact(stream, memoryview(header), FRAME_STALL_S)
        payload = empty(payload_size)
        if crc32c(header) != header_crc:
            stream.recv_payload(payload, FRAME_STALL_S, f32=False)  # frame boundary kept
            with self._lock:
                self.corrupt_frames += 1
            self.refusals.note(peer, "bulk frame failed its checksum (sent again)")
            stream.send(bytes([RESEND]))
            return True
        try:
            chunk = parse_header(bytes(header))
        except WireError as exc:
            msg = f"malformed isthmus.v1.PushChunksRequest: {exc}"
            self.refusals.note(peer, "bulk frame refused: malformed PushChunksRequest", str(exc))
            self._refuse(stream, grpc.StatusCode.INVALID_ARGUMENT, msg)
            return False
        crc, finite = stream.recv_payload(payload, FRAME_STALL_S, f32=chunk.codec == "raw")
        chunk.payload, chunk.payload_crc, chunk.payload_finite = payload.toreadonly(), crc, finite
        status, code, why = self._accept(chunk, peer, holder)
        if status == REFUSED:
            self._refuse(stream, code or grpc.StatusCode.INVALID_ARGUMENT, why)
            return False
        stream.send(bytes([status]))
        return True

    @staticmethod
    def _refuse(stream: Stream, code: grpc.StatusCode, why: str) -> None:
        """Sends the refusal, then closes without a reset (``Stream.refuse``)."""
        reason = why.encode("utf-8", errors="replace")[:1024]
        stream.refuse(
            bytes([REFUSED]) + _REFUSAL.pack(code.value[0], len(reason)) + reason, LINGER_S
        )

    def drop_connections(self) -> None:
        """Closes every open connection; the listener stays, and peers dial again."""
        self._close_connections()

    def stop(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._close_connections()

    def _close_connections(self) -> None:
        with self._lock:
            conns, self.conns = list(self.conns), set()
        for conn in conns:
            # Shut, not closed: its thread wakes and closes it (a descriptor closed under
            # a thread still reading it could be another connection's a moment later).
            shut(conn)


def _peer(addr: tuple) -> str:
    """A socket's peer address as gRPC writes one ("ipv4:10.0.0.1:5555",
    "ipv6:[::1]:5555"), so that refusals from one host are one caller's."""
    host, port = addr[0], addr[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def record_head(header: bytes, payload_bytes: int) -> bytes:
    """The 16 bytes that go before a frame on a bulk connection (module docstring)."""
    first = struct.pack("<III", len(header), payload_bytes, crc32c(header))
    return first + struct.pack("<I", crc32c(first))


def frame_parts(frame: Frame) -> list[bytes | memoryview]:
    return [record_head(frame.header, frame.payload_bytes), frame.header, frame.payload]


def frame_bytes(message: bytes) -> bytes:
    """A whole ``PushChunksRequest`` encoding as the bytes of one bulk frame (for
    clients written by hand, and tests)."""
    return b"".join(frame_parts(Frame.from_message(message)))


def read_refusal(stream: Stream, status: int) -> BulkRefused:
    if status != REFUSED:
        return BulkRefused(grpc.StatusCode.INTERNAL, f"unknown bulk status {status}")
    head = bytearray(_REFUSAL.size)
    try:
        read_exact(stream, memoryview(head), LINGER_S)
        code, size = _REFUSAL.unpack(head)
        reason = bytearray(size)
        read_exact(stream, memoryview(reason), LINGER_S)
    except (OSError, BulkError):
        return BulkRefused(grpc.StatusCode.UNAVAILABLE, "refused (reason cut off)")
    return BulkRefused(_CODES.get(code, grpc.StatusCode.UNKNOWN), reason.decode(errors="replace"))
