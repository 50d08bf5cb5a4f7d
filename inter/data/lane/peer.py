"""The sending side of a lane: a :class:`LanePeer` sends to one peer site's lane, on its
bulk TCP port (:mod:`isthmus.inter.data.transport.bulk`) or on gRPC ``PushChunks`` calls
(:mod:`isthmus.inter.data.transport.push`), a round's worth as one ``PeerRound``. What
it asks of the peer (a chunk again, a ticket) comes back to this rank's own lane
(:mod:`isthmus.inter.data.lane.handoff`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from isthmus.inter.data.lane.gate import PASS_METADATA
from isthmus.inter.data.lane.mailbox import Handoffs
from isthmus.inter.data.transport.bulk import TICKET_TTL_S, BulkRefused
from isthmus.inter.data.transport.bulk_peer import BulkConnection
from isthmus.inter.data.transport.bulk_stream import client_context
from isthmus.inter.data.transport.chunk_checks import channel_options, stream_keepalive
from isthmus.inter.data.transport.link_watch import Link
from isthmus.inter.data.transport.peer_round import Connection, PeerRound
from isthmus.inter.data.transport.push import StreamConnection
from isthmus.inter.data.transport.wire import Frame, encode_delivery
from isthmus.inter.security import INSECURE, SiteSecurity
from isthmus.proto import lane_pb2, lane_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["TRANSPORTS", "LanePeer", "PeerRound"]

TRANSPORTS = ("auto", "bulk", "grpc")
RETIRE_S = 10.0
"""Seconds a channel left after a stall stays open for calls begun on it before."""

_RESEND = "/isthmus.v1.Lane/ResendChunk"
_DELIVER = "/isthmus.v1.Lane/DeliverChunk"
Home = tuple[int, Handoffs]
"""This rank's site index and its lane's :class:`Handoffs`: what a peer's hand-offs
(tickets granted, chunks delivered) are matched against."""


class LanePeer:
    """Client of one peer site's lane at ``address`` ("host:port"), through ``proxy``
    (HTTP CONNECT: the WAN emulator) if given. A round spreads its chunks over
    ``connections`` parallel TCP connections. ``transport``: "bulk" (the lane's bulk
    port, inter/data/transport/bulk.py, inside mutual TLS when ``security`` requires
    it), "grpc" (``PushChunks`` calls) or "auto" (bulk). ``link``: the peer site's link
    in the rank's ``LinkWatch``, handed the bulk connections.
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
        link: Link | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address = address
        self._lock = threading.Lock()  # the resend turn and the AbortRound calls
        self._fetches = 0
        self._aborting: set[grpc.Future] = set()  # AbortRound calls in flight
        base: list[tuple[str, int | str]] = [*channel_options(chunk_bytes), *stream_keepalive()]
        # Without an explicit proxy, ignore http_proxy/grpc_proxy from the environment.
        base += [("grpc.http_proxy", proxy)] if proxy else [("grpc.enable_http_proxy", 0)]
        security = security or INSECURE
        self._security = security
        self._base = base
        self._ids = itertools.count()
        self._channels = [self._dial() for _ in range(connections)]
        self._retired: list[grpc.Channel] = []  # left after a stall, closed soon (_renew)
        self._home: Home | None = None  # told by each round (begin_round)
        self._pass: tuple[bytes, float] | None = None  # a PushChunks pass and when it came
        if transport == "auto":
            transport = "bulk"
        self.transport = transport
        if link is not None:
            link.transport = transport
        host = address.rsplit(":", 1)[0].strip("[]")
        tls = client_context(security)
        self._bulk = [
            BulkConnection(host, self._open_bulk, proxy, f"{address}-{i}", tls=tls, link=link)
            for i in range(connections if transport == "bulk" else 0)
        ]
        self._streams = [
            StreamConnection(ch, self._renew, self._stream_pass, name=f"{address}-{i}")
            for i, ch in enumerate(self._channels if transport == "grpc" else ())
        ]

    def _dial(self) -> grpc.Channel:
        # A local subchannel pool and a distinct arg give each channel its own TCP
        # connection; identical channels would share one.
        extra = [("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", next(self._ids))]
        return self._security.channel(self.address, [*self._base, *extra])

    def _renew(self, old: grpc.Channel) -> grpc.Channel:
        """A new channel (a new TCP connection) in ``old``'s place: a connection that
        stalled (push.py) carries none of this peer's calls from now on. ``old``
        is closed :data:`RETIRE_S` later, so that a call another thread just began on
        it (a ``ResendChunk``) is not cancelled under it; the chunks that were in flight
        on it went again already."""
        new = self._dial()
        with self._lock:
            self._channels = [new if ch is old else ch for ch in self._channels]
            self._retired.append(old)
        timer = threading.Timer(RETIRE_S, self._close_retired, args=(old,))
        timer.daemon = True
        timer.start()
        return new

    def _close_retired(self, old: grpc.Channel) -> None:
        with self._lock:
            if old not in self._retired:
                return  # closed with the peer
            self._retired.remove(old)
        old.close()

    def _channel(self, turn: int) -> grpc.Channel:
        with self._lock:
            return self._channels[turn % len(self._channels)]

    def _open_bulk(self, timeout: float) -> tuple[int, bytes]:
        """A ticket to the peer lane's bulk port: ``OpenBulk`` asks, and the peer grants
        it to this rank's own lane (``GrantBulk``) before it answers."""
        if self._home is None:
            raise BulkRefused(
                grpc.StatusCode.FAILED_PRECONDITION, "no round told this lane its own site"
            )
        me, handoffs = self._home
        nonce = handoffs.expect(("ticket",))
        reply = lane_pb2_grpc.LaneStub(self._channel(0)).OpenBulk(
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

    def _turn(self) -> grpc.Channel:
        """The next connection: they take turns, so that a resend does not queue behind
        one busy stream."""
        with self._lock:
            turn, self._fetches = self._fetches, self._fetches + 1
        return self._channel(turn)

    def fetch(self, request: lane_pb2.ResendChunkRequest, timeout: float) -> None:
        """Asks the peer for one chunk again (``ResendChunk``); the peer hands it to
        this rank's lane (``DeliverChunk``) with ``request.nonce`` before it answers;
        grpc.RpcError if the peer refused, has no such chunk or did not answer."""
        call = self._turn().unary_unary(
            _RESEND,
            request_serializer=lane_pb2.ResendChunkRequest.SerializeToString,
            response_deserializer=lane_pb2.ResendChunkResponse.FromString,
        )
        call(request, timeout=max(0.001, timeout))

    def deliver(self, frame: Frame | bytes, nonce: bytes, timeout: float) -> None:
        """Hands a chunk this site sent to the peer's lane again (``DeliverChunk``),
        for its round's request ``nonce`` (PERMISSION_DENIED if it did not ask)."""
        call = self._turn().unary_unary(
            _DELIVER,
            request_serializer=None,  # already bytes (encode_delivery)
            response_deserializer=lane_pb2.DeliverChunkResponse.FromString,
        )
        message = frame.joined() if isinstance(frame, Frame) else frame
        call(encode_delivery(message, nonce), timeout=max(0.001, timeout))

    def grant_bulk(self, request: lane_pb2.GrantBulkRequest, timeout: float) -> None:
        """Hands the peer's lane the ticket it asked for (``GrantBulk``; PERMISSION_DENIED
        if it did not ask)."""
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
        return lane_pb2_grpc.LaneStub(self._channel(0))

    def begin_round(self, deadline: float, home: Home | None = None) -> PeerRound:
        """Opens a round whose chunks must be taken by ``deadline`` (time.monotonic()).
        ``home``: this rank's site index and lane hand-offs, where the peer grants the
        tickets that admit this site's chunks (``OpenBulk``)."""
        if home is not None:
            self._home = home
        conns: list[Connection] = [*self._bulk] if self._bulk else [*self._streams]
        return PeerRound(conns, deadline)

    def close(self) -> None:
        """Closes the connections and the channels (calls in flight are cancelled)."""
        for conn in self._bulk:
            conn.close()
        for stream in self._streams:
            stream.close()
        with self._lock:
            channels = [*self._channels, *self._retired]
            self._retired.clear()
        for channel in channels:
            channel.close()
