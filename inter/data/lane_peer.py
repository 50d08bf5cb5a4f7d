"""The sending side of a lane: one client per peer site.

A :class:`LanePeer` sends to one peer site's :class:`~isthmus.inter.data.lane.LaneServer`,
on its bulk TCP port (:mod:`isthmus.inter.data.bulk`, the default without TLS) or on gRPC:
per round and per connection, one client-streaming ``PushChunks`` fed from a queue,
so encoding (the callers) and sending overlap. A :class:`PeerRound` is one round's
worth of those streams (:class:`~isthmus.inter.data.bulk.BulkPeerRound` on bulk). :meth:`LanePeer.fetch` asks for one chunk
again (``ResendChunk``) when the copy that arrived failed its checksum; the peer hands it
to this rank's own lane (:mod:`isthmus.inter.data.lane_handoff`), as it grants the
tickets that admit this rank's chunks to its bulk port (or its ``PushChunks`` streams).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from isthmus.inter.data.bulk import TICKET_TTL_S, BulkRefused
from isthmus.inter.data.bulk_peer import BulkConnection, BulkPeerRound
from isthmus.inter.data.lane import PASS_METADATA, channel_options
from isthmus.inter.data.lane_handoff import Handoffs
from isthmus.inter.data.wire import Frame, encode_delivery
from isthmus.inter.security import INSECURE, SiteSecurity
from isthmus.proto import lane_pb2, lane_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["TRANSPORTS", "LanePeer", "PeerRound"]

TRANSPORTS = ("auto", "bulk", "grpc")

_POLL_S = 0.1  # how often a waiting stream looks at its call and deadline
_PUSH = "/isthmus.v1.Lane/PushChunks"
_RESEND = "/isthmus.v1.Lane/ResendChunk"
_DELIVER = "/isthmus.v1.Lane/DeliverChunk"
Home = tuple[int, Handoffs]
"""This rank's site index and its lane's :class:`Handoffs`: what a peer's hand-offs
(tickets granted, chunks delivered) are matched against."""


_END = object()  # end-of-stream marker


class _Stream:
    """One round's ``PushChunks`` call on one connection, fed from a queue.

    grpcio pulls the request iterator on a thread of its own, so encoding (the
    callers of :meth:`put`) and sending overlap with no sender thread of ours, and
    several rounds' streams share a connection as HTTP/2 streams.
    """

    def __init__(
        self, call: grpc.StreamUnaryMultiCallable, deadline: float, metadata: tuple = ()
    ) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._deadline = deadline
        self._closed = False
        # wait_for_ready: a peer still starting is waited for, up to the deadline.
        self.future = call.future(
            self._frames(),
            timeout=max(0.001, deadline - time.monotonic()),
            wait_for_ready=True,
            metadata=metadata or None,
        )

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def close(self) -> None:
        """Ends the stream once queued frames are out."""
        self.put(_END)

    def _frames(self) -> Iterator[bytes]:
        while True:
            with self._cond:
                while not self._items:
                    left = self._deadline - time.monotonic()
                    if left <= 0 or self.future_done():
                        return  # the call's own deadline fails it; nothing more to send
                    self._cond.wait(min(_POLL_S, left))
                item = self._items.popleft()
            if item is _END:
                return
            yield item

    def future_done(self) -> bool:
        fut = getattr(self, "future", None)
        return fut is not None and fut.done()


class PeerRound:
    """The chunks sent to one peer in one round, spread over the peer's connections.

    Each connection gets its own stream for the round, opened with the first chunk
    for it; rounds are independent, so several can be in flight at once.
    """

    def __init__(
        self,
        calls: list[grpc.StreamUnaryMultiCallable],
        deadline: float,
        metadata: Callable[[float], tuple] | None = None,
    ) -> None:
        self._calls = calls
        self._deadline = deadline
        self._metadata = metadata  # the stream's pass, without TLS (LanePeer._pass)
        self._streams: list[_Stream | None] = [None] * len(calls)
        self._next = 0
        self._ended = False
        self._lock = threading.Lock()  # encode/decode pool threads send concurrently
        self.sent = 0
        self.resent = 0
        """Always 0 here: a damaged chunk is pulled again by the receiver instead."""
        self.stalls = 0
        """Always 0 here: a stalled stream meets the round's deadline (bulk only)."""

    def send(self, frame: Frame) -> None:
        """Queues one chunk (serialized here, the payload's one copy); connections take
        turns. Thread-safe.

        A chunk sent after :meth:`end` (a failing round's stragglers) is dropped.
        """
        with self._lock:
            if self._ended:
                return
            i = self._next
            self._next = (i + 1) % len(self._calls)
            self.sent += 1
            stream = self._streams[i]
            if stream is None:
                metadata = self._metadata(self._deadline) if self._metadata else ()
                stream = self._streams[i] = _Stream(self._calls[i], self._deadline, metadata)
        stream.put(frame.joined())

    def end(self) -> None:
        """Closes the round's streams once queued chunks are out (idempotent)."""
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            for stream in self._streams:
                if stream is not None:
                    stream.close()

    def _futures(self) -> list[grpc.Future]:
        with self._lock:
            return [s.future for s in self._streams if s is not None]

    def failure(self) -> BaseException | None:
        """Returns the first stream's error so far, without waiting."""
        for fut in self._futures():
            if fut.done() and fut.exception() is not None:
                return fut.exception()
        return None

    def wait(self, timeout: float) -> int:
        """Waits for every stream's answer; returns chunks the peer took.

        A chunk is taken when it was accepted or marked corrupt (the peer pulls
        those again with ``ResendChunk``).

        Raises:
            grpc.RpcError: a stream was refused or failed.
            TimeoutError: no answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        total = 0
        for fut in self._futures():
            try:
                reply = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError as exc:
                raise TimeoutError("no answer from the peer in time") from exc
            total += reply.accepted + reply.corrupt
        return total


class LanePeer:
    """Client of one peer site's lane.

    Args:
        address: the peer's "host:port".
        chunk_bytes: the job's chunk size (sets the message size limits).
        proxy: optional HTTP CONNECT proxy URL (e.g. the WAN emulator).
        connections: parallel TCP connections; a round spreads its chunks over them.
        security: mutual TLS and the job token (`isthmus.inter.security`); None = off.
        transport: "bulk" (chunks on the lane's plain TCP port, inter/data/bulk.py), "grpc"
            (``PushChunks`` streams) or "auto": bulk unless mutual TLS is on, since bulk
            payloads cross in the clear.
    """

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = 1 << 20,
        proxy: str | None = None,
        connections: int = 1,
        security: SiteSecurity | None = None,
        transport: str = "auto",
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address = address
        self._lock = threading.Lock()  # the resend turn and the AbortRound calls
        self._fetches = 0
        self._aborting: set[grpc.Future] = set()  # AbortRound calls in flight
        base: list[tuple[str, int | str]] = [*channel_options(chunk_bytes)]
        # Without an explicit proxy, ignore http_proxy/grpc_proxy from the environment.
        base += [("grpc.http_proxy", proxy)] if proxy else [("grpc.enable_http_proxy", 0)]
        security = security or INSECURE
        self._channels = [
            # A local subchannel pool and a distinct arg give each channel its own TCP
            # connection; identical channels would share one.
            security.channel(
                address, [*base, ("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)]
            )
            for i in range(connections)
        ]
        # The bulk calls take and give bytes (inter/data/wire.py), not protobuf objects.
        self._push = [
            ch.stream_unary(
                _PUSH,
                request_serializer=None,
                response_deserializer=lane_pb2.PushChunksResponse.FromString,
            )
            for ch in self._channels
        ]
        self._resend = [
            ch.unary_unary(
                _RESEND,
                request_serializer=lane_pb2.ResendChunkRequest.SerializeToString,
                response_deserializer=lane_pb2.ResendChunkResponse.FromString,
            )
            for ch in self._channels
        ]
        self._deliver = [
            ch.unary_unary(
                _DELIVER,
                request_serializer=None,  # already bytes (encode_delivery)
                response_deserializer=lane_pb2.DeliverChunkResponse.FromString,
            )
            for ch in self._channels
        ]
        self._home: Home | None = None  # told by each round (begin_round)
        self._security = security
        self._pass: tuple[bytes, float] | None = None  # a PushChunks pass and when it came
        if transport == "auto":
            transport = "grpc" if security.require_tls else "bulk"
        self.transport = transport
        host = address.rsplit(":", 1)[0].strip("[]")
        self._bulk = [
            BulkConnection(host, self._open_bulk, proxy, name=f"{address}-{i}")
            for i in range(connections if transport == "bulk" else 0)
        ]

    def _open_bulk(self, timeout: float) -> tuple[int, bytes]:
        """A ticket to the peer lane's bulk port: ``OpenBulk`` asks, and the peer grants
        it to this rank's own lane (``GrantBulk``) before it answers."""
        if self._home is None:
            raise BulkRefused(
                grpc.StatusCode.FAILED_PRECONDITION, "no round told this lane its own site"
            )
        me, handoffs = self._home
        nonce = handoffs.expect(("ticket",))
        reply = lane_pb2_grpc.LaneStub(self._channels[0]).OpenBulk(
            lane_pb2.OpenBulkRequest(from_site=me, nonce=nonce),
            timeout=timeout,
            wait_for_ready=True,
        )
        granted = handoffs.collect(nonce, 0.0)
        if granted is None:
            raise BulkRefused(
                grpc.StatusCode.UNAUTHENTICATED, f"{self.address} answered but granted no ticket"
            )
        port: int
        ticket: bytes
        port, ticket = granted  # type: ignore[misc]  # what take_grant stored
        return port or reply.port, ticket

    def _stream_pass(self, deadline: float) -> tuple:
        """Without TLS, the metadata a ``PushChunks`` stream presents: a ticket the peer
        granted this site, renewed at half its life; with TLS, none (the certificate)."""
        if self._security.require_tls:
            return ()
        with self._lock:
            held = self._pass
        if held is None or time.monotonic() - held[1] > TICKET_TTL_S / 2:
            delay = 0.05
            while True:
                left = deadline - time.monotonic()
                try:
                    ticket = self._open_bulk(max(0.001, min(left, 10.0)))[1]
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or left <= delay:
                        raise
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            held = (ticket, time.monotonic())
            with self._lock:
                self._pass = held
        return ((PASS_METADATA, held[0].hex()),)

    def fetch(self, request: lane_pb2.ResendChunkRequest, timeout: float) -> None:
        """Asks the peer for one chunk again (``ResendChunk``); the peer hands it to
        this rank's lane (``DeliverChunk``) with ``request.nonce`` before it answers.

        Args:
            request: which chunk, who asks, and the nonce the chunk comes back with.
            timeout: deadline of the call in seconds.
        Raises:
            grpc.RpcError: the peer refused, has no such chunk or did not answer.
        """
        # Connections take turns so a resend does not queue behind one busy stream.
        with self._lock:
            call = self._resend[self._fetches % len(self._resend)]
            self._fetches += 1
        call(request, timeout=max(0.001, timeout))

    def deliver(self, frame: Frame | bytes, nonce: bytes, timeout: float) -> None:
        """Hands a chunk this site sent to the peer's lane again (``DeliverChunk``),
        for its round's request ``nonce``.

        Raises:
            grpc.RpcError: PERMISSION_DENIED if the peer's lane did not ask for it.
        """
        with self._lock:
            call = self._deliver[self._fetches % len(self._deliver)]
            self._fetches += 1
        message = frame.joined() if isinstance(frame, Frame) else frame
        call(encode_delivery(message, nonce), timeout=max(0.001, timeout))

    def grant_bulk(self, request: lane_pb2.GrantBulkRequest, timeout: float) -> None:
        """Hands the peer's lane the ticket it asked for (``GrantBulk``).

        Raises:
            grpc.RpcError: PERMISSION_DENIED if the peer's lane did not ask for it.
        """
        self.stub.GrantBulk(request, timeout=max(0.001, timeout))

    def abort_round(self, request: lane_pb2.AbortRoundRequest, timeout: float) -> None:
        """Tells the peer that this site gave up a round (``AbortRound``), without
        waiting: the caller's round has failed already, and a dead peer must not hold
        it. A failed call is logged; the peer then meets its round's deadline."""
        call = self.stub.AbortRound.future(request, timeout=max(0.001, timeout))
        # grpc cancels a call whose future is collected: hold it until it ends.
        with self._lock:
            self._aborting.add(call)
        call.add_done_callback(self._aborted)

    def _aborted(self, call: grpc.Future) -> None:
        with self._lock:
            self._aborting.discard(call)
        if not call.cancelled() and call.exception() is not None:
            log.info("AbortRound to %s failed: %s", self.address, call.exception())

    @property
    def stub(self) -> lane_pb2_grpc.LaneStub:
        """A stub on the first connection, for one-off calls (``PullState``)."""
        return lane_pb2_grpc.LaneStub(self._channels[0])

    def begin_round(self, deadline: float, home: Home | None = None) -> PeerRound | BulkPeerRound:
        """Opens a round whose chunks must be taken by ``deadline`` (time.monotonic()).

        Args:
            deadline: when the round's chunks must have been taken.
            home: this rank's site index and lane hand-offs, where the peer grants the
                tickets that admit this site's chunks (``OpenBulk``).
        """
        if home is not None:
            self._home = home
        if self._bulk:
            return BulkPeerRound(self._bulk, deadline)
        return PeerRound(self._push, deadline, self._stream_pass)

    def close(self) -> None:
        """Closes the bulk connections and the channels (open streams are cancelled)."""
        for conn in self._bulk:
            conn.close()
        for channel in self._channels:
            channel.close()
