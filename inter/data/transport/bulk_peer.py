"""The sending side of the bulk transport (protocol in :mod:`.bulk`): a
:class:`BulkConnection` is one TCP connection to a peer lane's bulk port, shared by that
peer's rounds; a connection whose frame misses its deadline (:mod:`.flow_clock`) is left
for a new one (docs/wire.md, "Deadlines per frame").
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlsplit

import grpc

from isthmus.inter.data.transport import bulk, flow_clock
from isthmus.inter.data.transport.bulk import BulkError, BulkRefused, read_exact
from isthmus.inter.data.transport.bulk_stream import PlainStream, Stream, TlsStream, tune
from isthmus.inter.data.transport.link_watch import Link
from isthmus.inter.data.transport.peer_round import PeerRound
from isthmus.inter.data.transport.wire import Frame

__all__ = ["BulkConnection"]

log = logging.getLogger(__name__)


class _Sent(NamedTuple):
    """A frame on the wire of a connection, not yet acknowledged."""

    rnd: PeerRound
    frame: Frame
    at: float  # when it was handed to the socket (time.monotonic())


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
    acknowledgement to the round that sent the frame. A connection refused by the
    peer fails the rounds with frames in flight; one lost under them (a reset, a TLS
    record that failed its MAC) sends them again on a new one (:meth:`_lost`).

    A connection whose oldest frame misses its deadline (:meth:`_due_locked`) is stalled
    (a flow black-holed on the way, a peer that stopped reading): it is closed, its
    frames in flight go first on a new connection (a new flow), and the rounds go on.
    The peer's lane stores a chunk at most once (``Mailbox.deposit``), so a frame that
    did arrive on the stalled connection is not summed twice.

    ``open_bulk(timeout)`` asks the peer's lane for (port, ticket) over gRPC (the
    ticket is granted to this rank's own lane: ``LanePeer._open_bulk``); ``proxy`` is an
    HTTP CONNECT proxy URL (the WAN emulator); ``tls`` is ``bulk_stream.client_context``;
    ``link`` is told when frames are in flight here and reads :meth:`watch` once a step.
    """

    def __init__(
        self,
        host: str,
        open_bulk: Callable[[float], tuple[int, bytes]],
        proxy: str | None,
        name: str,
        tls: ssl.SSLContext | None = None,
        link: Link | None = None,
    ) -> None:
        self._host, self._open_bulk, self._proxy, self._name = host, open_bulk, proxy, name
        self._tls = tls
        self._cond = threading.Condition()
        self._queue: deque[tuple[PeerRound, Frame]] = deque()
        self._inflight: deque[_Sent] = deque()
        self._sock: Stream | None = None
        self._closed = False
        self._dial_lock = threading.Lock()
        self._clock = flow_clock.FlowClock()
        self._losses = 0  # connections lost in a row under frames (reset by an ack)
        self._bytes_put = 0
        self._lost_to: BaseException | None = None  # why the connection redialled was lost
        self.stalls = 0  # times it stalled and its frames went again on a new one
        self._link, self._on_wire, self._acked_bytes = link, False, 0
        if link is not None:
            link.add(self)

    def put(self, rnd: PeerRound, frame: Frame) -> None:
        with self._cond:
            if self._closed:
                raise BulkError("connection closed")
            self._queue.append((rnd, frame))
            self._bytes_put += frame.payload_bytes
            self._cond.notify_all()
        self._ensure(rnd.deadline)

    def load(self) -> tuple[int, int]:
        """Payload bytes queued or in flight here, not yet acknowledged, and payload
        bytes ever queued here (:meth:`PeerRound.send` picks the least loaded)."""
        with self._cond:
            queued = sum(frame.payload_bytes for _, frame in self._queue)
            backlog = queued + sum(sent.frame.payload_bytes for sent in self._inflight)
            return backlog, self._bytes_put

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

    def _connect(self, deadline: float) -> Stream:
        # Like gRPC's wait_for_ready: a peer still starting is retried until the deadline,
        # and so, a few times, is a connection closed before the peer's answer (a lane
        # dropping its connections, a middlebox): a peer that refuses says why instead.
        delay, closed_in_hello = 0.05, 0
        while True:
            left = deadline - time.monotonic()
            try:
                port, ticket = self._open_bulk(max(0.001, min(left, 10.0)))
                sock = _dial(self._host, port, self._proxy, max(0.001, min(left, 10.0)))
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if left <= delay:
                    raise
            except OSError:
                if left <= delay:
                    raise
            else:
                try:
                    return self._hello(sock, ticket)
                except _CLOSED_IN_HELLO:
                    closed_in_hello += 1
                    if closed_in_hello > MAX_HELLO_CLOSES or left <= delay:
                        raise
            time.sleep(delay)
            # Short: UNAVAILABLE also means the peer's round with this site has not
            # begun yet, and its ticket follows within moments of that.
            delay = min(delay * 2, 0.25)

    def _hello(self, sock: socket.socket, ticket: bytes) -> Stream:
        """TLS (if on), the ticket, and the peer's answer on a dialled socket."""
        stream: Stream = PlainStream(sock)
        try:
            tune(sock)
            if self._tls is not None:
                tls = TlsStream.wrap(sock, self._tls, server_side=False)
                stream = TlsStream.handshake(tls, bulk.HELLO_TIMEOUT_S)
            stream.send(bulk.MAGIC + ticket)
            answer = bytearray(1)
            read_exact(stream, memoryview(answer), bulk.HELLO_TIMEOUT_S)
            if answer[0] != bulk.OK:
                raise bulk.read_refusal(stream, answer[0])
            if isinstance(stream, PlainStream):
                sock.settimeout(None)
            return stream
        except BaseException:
            stream.close()
            raise

    def _run(self, deadline: float) -> None:
        try:
            sock = self._connect(deadline)
        except BaseException as exc:  # noqa: BLE001 (handed to the rounds waiting)
            with self._cond:
                lost, self._lost_to = self._lost_to, None
            if lost is not None:  # a redial after a loss: say what was lost
                within = flow_clock.LOSS_REDIAL_S
                exc = BulkError(
                    f"connection lost ({lost}) and no new one within {within:g}s: {exc}"
                )
            self._fail(exc, None, queued_too=True)  # nothing can be sent
            return
        with self._cond:
            self._lost_to = None
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
                if idle and sock.idle_closed():
                    self._fail(BulkError("the peer closed the idle connection"), sock)
                    return
                with self._cond:
                    # Checked again under the lock: a stall may have moved the frames in
                    # flight back to the queue and handed it to a new connection.
                    if self._closed or self._sock is not sock or not self._queue:
                        return
                    rnd, frame = self._queue.popleft()
                    self._inflight.append(_Sent(rnd, frame, time.monotonic()))
                    self._wire_locked()
                sock.send_parts(bulk.frame_parts(frame))  # from where the payload lies
        except OSError as exc:
            # The peer may have refused a frame and closed: its reason is what the
            # rounds should hear, so the reader gets a moment to read it first.
            reader.join(timeout=bulk.LINGER_S)
            self._lost(BulkError(f"sending failed: {exc}"), sock)

    def _read_acks(self, sock: Stream) -> None:
        status = bytearray(1)
        try:
            while self._await_ack(sock):
                read_exact(sock, memoryview(status))
                if status[0] == bulk.REFUSED:
                    raise bulk.read_refusal(sock, status[0])
                if status[0] not in (bulk.ACCEPTED, bulk.CORRUPT, bulk.RESEND):
                    raise BulkError(f"unknown acknowledgement {status[0]}")
                now = time.monotonic()
                with self._cond:
                    if self._sock is not sock:
                        return  # stalled and replaced: its frames went again elsewhere
                    item = self._inflight.popleft() if self._inflight else None
                    if item is not None:
                        self._losses = 0
                        size = item.frame.payload_bytes + len(item.frame.header)
                        self._clock.acknowledged(item.at, size, now)  # the measured rate
                        self._acked_bytes += size
                        self._wire_locked()
                        if status[0] == bulk.RESEND:
                            # Sent next; every frame already in flight is acknowledged
                            # before it, so the in-flight order stays the ack order.
                            self._queue.appendleft((item.rnd, item.frame))
                            self._cond.notify_all()
                if item is None:
                    raise BulkError("acknowledgement for a frame never sent")
                item.rnd.acknowledged(status[0])
        except BulkRefused as exc:
            self._fail(exc, sock)  # the peer said no: its reason goes to the rounds
        except (OSError, BulkError) as exc:
            self._lost(exc, sock)

    def _await_ack(self, sock: Stream) -> bool:
        """Waits until an acknowledgement can be read (True), or until the oldest frame
        in flight misses its deadline (then :meth:`_stalled`) or the connection was
        replaced (False)."""
        while True:
            with self._cond:
                if self._sock is not sock:
                    return False
                due = self._due_locked()
            now = time.monotonic()
            if now >= due:
                self._stalled(sock, now)
                return False
            # Waking at least every half second: a frame sent meanwhile sets a deadline.
            if sock.wait_readable(min(due - now, 0.5)):
                return True

    def _due_locked(self) -> float:
        oldest = self._inflight[0] if self._inflight else None
        if oldest is None:
            return math.inf
        return self._clock.due(oldest.at, oldest.frame.payload_bytes + len(oldest.frame.header))

    def _stalled(self, sock: Stream, now: float) -> None:
        """The oldest frame missed its deadline: the frames in flight go first on a new
        connection, this one is closed, and the rounds are told (``stalls``)."""
        with self._cond:
            if self._sock is not sock or not self._inflight:
                return
            began = self._clock.began(self._inflight[0].at)
            allowed = self._due_locked() - began
            items = self._requeue_inflight_locked()
            self._clock.stalled()
            self.stalls += 1
            redial = None if self._closed else self._queue[0][0].deadline
        log.warning(
            "bulk connection %s stalled: a %.2f MB frame unacknowledged after %.1fs (its "
            "deadline: %.1fs at %.0f MB/s); its %d frame(s) in flight go again on a new "
            "connection",
            self._name,
            items[0].frame.payload_bytes / 1e6,
            now - began,
            allowed,
            (self._clock.rate or flow_clock.FIRST_RATE_BPS) / 1e6,
            len(items),
        )
        self._leave(sock, items, redial)

    def _requeue_inflight_locked(self) -> list[_Sent]:
        """Puts the frames in flight back first in the queue, in order, and drops the
        connection; returns them."""
        items = list(self._inflight)
        self._inflight.clear()
        self._wire_locked()
        self._queue.extendleft((i.rnd, i.frame) for i in reversed(items))
        self._sock = None
        self._cond.notify_all()
        return items

    def _leave(self, sock: Stream, items: list[_Sent], redial: float | None) -> None:
        """Closes a connection left with ``items`` (requeued) and dials a new one."""
        sock.shutdown()  # wakes this connection's other thread
        sock.close()
        items[0].rnd.stalled()  # counted once: a flow left, the round went on
        if redial is not None:
            self._ensure(redial)

    def _lost(self, exc: BaseException, sock: Stream) -> None:
        """The connection broke under frames in flight (a reset; under TLS a record
        that failed its MAC, which the peer answers by closing): they go first on a new
        connection, as a stalled one's do (the peer stores a chunk at most once), and
        the rounds go on. The redial must succeed within ``LOSS_REDIAL_S`` (a peer that
        went away fails its rounds then, not at their deadline), and past ``MAX_LOSSES``
        losses in a row the rounds fail (:meth:`_fail`)."""
        with self._cond:
            if self._sock is not sock:
                return  # an older connection's late news
            resend = None
            if not self._closed and self._inflight and self._losses < flow_clock.MAX_LOSSES:
                self._losses += 1
                resend = self._requeue_inflight_locked()
                self._lost_to = exc
                redial = min(
                    self._queue[0][0].deadline, time.monotonic() + flow_clock.LOSS_REDIAL_S
                )
        if resend is None:
            self._fail(exc, sock)
            return
        log.warning(
            "bulk connection %s lost (%s); its %d frame(s) in flight go again on a new connection",
            self._name,
            exc,
            len(resend),
        )
        self._leave(sock, resend, redial)

    def _fail(self, exc: BaseException, sock: Stream | None, queued_too: bool = False) -> None:
        """The connection is gone: rounds with frames in flight on it fail (those may
        or may not have arrived), and so do their queued frames; other rounds' queued
        frames were never sent and go out on a new connection."""
        with self._cond:
            if sock is not None and self._sock is not sock:
                return  # an older connection's late news
            failed = {id(i.rnd): i.rnd for i in self._inflight}
            if queued_too:
                failed.update((id(r), r) for r, _ in self._queue)
            self._inflight.clear()
            self._wire_locked()
            self._queue = deque(item for item in self._queue if id(item[0]) not in failed)
            old, self._sock = self._sock, None
            redial = self._queue[0][0].deadline if self._queue and not self._closed else None
            self._cond.notify_all()
        if isinstance(old, PlainStream | TlsStream):
            old.close()
        for rnd in failed.values():
            rnd.failed(exc)
        if redial is not None:
            self._ensure(redial)

    def _wire_locked(self) -> None:
        """Tells the link when frames in flight here go from none to some or back."""
        busy = bool(self._inflight) and not self._closed
        if self._link is not None and busy != self._on_wire:
            self._on_wire = busy
            self._link.wire(busy)

    def watch(self) -> tuple[socket.socket | None, int, bool]:
        """The TCP socket now (None while dialling), the frame bytes acknowledged here,
        and whether the connection is closed (``link_watch.Flow``)."""
        with self._cond:
            stream, acked, closed = self._sock, self._acked_bytes, self._closed
        if isinstance(stream, PlainStream | TlsStream):
            return stream.sock, acked, closed
        return None, acked, closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._wire_locked()
            sock, self._sock = self._sock, None
            self._cond.notify_all()
        if isinstance(sock, PlainStream | TlsStream):
            sock.shutdown()
            sock.close()


_CLOSED_IN_HELLO = (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
"""How a connection closed by the peer (or on the way) before its answer ends: a reset,
a broken pipe, an EOF in the TLS handshake or before the answer byte (FrameClosed).
A certificate refused ends in another ssl.SSLError, and is not dialled again."""

MAX_HELLO_CLOSES = 3
"""Connections closed in their hello in a row before a dial gives up (and the rounds
fail at once, not at their deadline)."""

_PENDING: Stream = object()  # type: ignore[assignment]  # dialling
