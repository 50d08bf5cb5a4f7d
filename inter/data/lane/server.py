"""The receiving side of a lane: a :class:`LaneServer` takes ``PushChunks`` streams and
a bulk port's chunks, judges each (:mod:`isthmus.inter.data.transport.chunk_checks`, and
whose name it carries: :mod:`.gate`) and deposits the sound ones in its ``Mailbox``; a
chunk whose only fault is its crc32 is marked there, and the round pulls it again. Its
other calls go to :mod:`.handoff` and :mod:`.requests`, each handed what it uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.bounds import BoundedHealth, RefusalLog, WaitSlots
from isthmus.inter.control.channels import bind_failure, server_options
from isthmus.inter.data.lane.gate import ANY_SENDER, PASS_METADATA, LaneGate
from isthmus.inter.data.lane.handoff import LaneHandoff
from isthmus.inter.data.lane.mailbox import MAX_STEPS_AHEAD, Mailbox, Outbox
from isthmus.inter.data.lane.requests import PULL_STATE_SHARE, LaneRequests
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.state.offers import StateOffers
from isthmus.inter.data.transport.bulk import ACCEPTED, CORRUPT, REFUSED, BulkListener, Tickets
from isthmus.inter.data.transport.bulk_stream import server_context
from isthmus.inter.data.transport.chunk_checks import (
    CRC_MISMATCH,
    Refused,
    channel_options,
    max_payload_bytes,
    stream_ping_policy,
    validate_chunk,
)
from isthmus.inter.data.transport.wire import Chunk, ChunkWire, DeliverWire
from isthmus.inter.malformed import MalformedRequests
from isthmus.inter.security import INSECURE, SiteSecurity
from isthmus.proto import lane_pb2, lane_pb2_grpc

__all__ = ["ANY_SENDER", "PASS_METADATA", "LaneServer", "channel_options", "max_payload_bytes"]

log = logging.getLogger(__name__)

_GENERATIONS_AHEAD = 2
"""Generations past this lane's whose chunks it holds for a moment (see ``take``)."""
_GENERATION_WAIT_S = 10.0  # how long a chunk of a newer generation waits for this lane
_MAILBOX_REFUSALS = {  # Mailbox.deposit's answers, as the sender hears them
    "duplicate": (grpc.StatusCode.ALREADY_EXISTS, "duplicate chunk {key}"),
    "stale": (grpc.StatusCode.FAILED_PRECONDITION, "chunk {key} belongs to a finished step"),
    "ahead": (
        grpc.StatusCode.FAILED_PRECONDITION,
        "chunk {key} is for a step {ahead} or more past the live one",
    ),
    "full": (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "chunk {key}: the mailbox holds its budget of {bytes} bytes of chunks no round has taken",
    ),
}

RESERVED_THREADS = 8
"""A lane's handler threads that ``PushChunks`` streams may never take."""
PULL_STATE_SLOTS = 2 * PULL_STATE_SHARE
"""``PullState`` calls a lane serves at once, each asking site its share, held only for
the pull's check and stream: a pull never waits for a state (issue 63). 40 calls held
waiting once took every thread of a lane for 50 s (issue 33, row 3)."""


class LaneServer(lane_pb2_grpc.LaneServicer):
    """The receiving side of one rank's lane.

    ``codec`` is the name every sender must use; ``chunk_bytes`` bounds payloads and
    messages. Each open stream holds one of ``max_workers`` handler threads for its
    round; all but :data:`RESERVED_THREADS` may hold ``PushChunks`` streams, so that
    streams nobody ends (issue 14, row 7) never take the threads of ``ResendChunk``,
    ``PullState``, ``OpenBulk`` and health checks. ``bulk``: also take chunks on a TCP
    port of their own (transport/bulk.py), inside mutual TLS when ``security`` requires
    it. ``mailbox_bytes`` (None: unbounded) wants room for two steps of this lane's
    traffic; ``steps_ahead`` (``Mailbox.max_ahead``) is a few steps, times the steps
    between rounds when the job syncs only every so many steps (DiLoCo).
    """

    def __init__(
        self,
        *,
        site_index: int,
        num_sites: int,
        codec: str,
        generation: int = 0,
        chunk_bytes: int = 1 << 20,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 32,
        security: SiteSecurity | None = None,
        bulk: bool = True,
        mailbox_bytes: int | None = None,
        steps_ahead: int = MAX_STEPS_AHEAD,
    ) -> None:
        members = Members(generation, site_index, num_sites)  # checks the index
        if chunk_bytes < 4 or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
        self.codec, self.chunk_bytes = codec, chunk_bytes
        self.mailbox = Mailbox(max_bytes=mailbox_bytes, max_ahead=steps_ahead)
        self.outbox = Outbox()
        self.offers = StateOffers()
        """The training state this rank offers the sites a commit admitted (``PullState``)."""
        self.rank = 0
        """This lane's rank in its site; a joiner pulls only from its own coordinate."""
        self.corruptions = 0
        """Chunks received with a payload that failed its crc32 (each pulled again)."""
        self._lock = threading.Condition()
        self._members = members  # replaced whole by set_members, never mutated
        self.security = security or INSECURE
        self.where = f"lane of site {site_index}"
        self.refusals = RefusalLog(self.where)
        """Every refusal of this lane, the token gate's too: one bounded log, one count."""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lane-rx"),
            options=server_options([*channel_options(chunk_bytes), *stream_ping_policy()]),
            interceptors=[
                *self.security.server_interceptors(self.where, self.refusals),
                MalformedRequests(),  # bytes that do not parse: INVALID_ARGUMENT
            ],
        )
        self.tickets = Tickets()
        """Bulk tickets (and PushChunks passes) granted, each bound to a site."""
        self.gate = LaneGate(
            security=self.security,
            where=self.where,
            refusals=self.refusals,
            tickets=self.tickets,
            members=lambda: self._members,
        )
        # grpc.health.v1, like every isthmus server: SERVING until stop().
        self.health = BoundedHealth(self.refusals)
        streams = max(1, max_workers - RESERVED_THREADS)
        self._streams = WaitSlots(streams, "PushChunks stream", self.refusals)
        # Taken from the reserved threads: the rest still answer at once.
        self.pulls = WaitSlots(PULL_STATE_SLOTS, "PullState", self.refusals)
        """Joining ranks pulling the state, each site its share (inter/data/lane/requests.py)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        for service in ("", "isthmus.v1.Lane"):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._address, self.bulk = self._listen(host, port, bulk)
        self.handoff = LaneHandoff(
            gate=self.gate,
            outbox=self.outbox,
            tickets=self.tickets,
            handoffs=self.mailbox.handoffs,
            bulk_port=self.bulk_port,
        )
        self.requests = LaneRequests(
            gate=self.gate,
            mailbox=self.mailbox,
            offers=self.offers,
            pulls=self.pulls,
            rank=lambda: self.rank,
        )
        self._server.add_generic_rpc_handlers((self._handlers(),))
        self._server.start()
        log.info("[site %d] lane server listening on %s", site_index, self._address)

    def _listen(self, host: str, port: int, bulk: bool) -> tuple[str, BulkListener | None]:
        """Binds the gRPC port and opens the bulk one (``bulk``): the address peers dial
        and the listener, which takes chunks at once."""
        bound = self.security.add_port(self._server, f"{host}:{port}")
        if bound == 0:
            where = f"{host}:{port}"
            raise OSError(f"could not bind lane server to {where}: {bind_failure(where)}")
        if not bulk:
            return f"{host}:{bound}", None
        listener = BulkListener(
            host,
            lambda req, peer, holder: self.take(req, holder, peer),
            max_frame=max_payload_bytes(self.chunk_bytes),
            where=self.where,
            refusals=self.refusals,
            tickets=self.tickets,
            tls=server_context(self.security),
            vouch=self.gate.vouches,
        )
        return f"{host}:{bound}", listener

    def _handlers(self) -> grpc.GenericRpcHandler:
        """The Lane service with the bulk messages read and written by
        :mod:`isthmus.inter.data.transport.wire`: a chunk's payload reaches the handler as
        a view, not a protobuf copy, and a resend goes out as the bytes first sent."""
        unary, pb, h, r = grpc.unary_unary_rpc_method_handler, lane_pb2, self.handoff, self.requests
        calls: dict[str, tuple[Any, ...]] = {  # name: (kind, handler, request, response)
            "PushChunks": (grpc.stream_unary_rpc_method_handler, self.PushChunks, ChunkWire,
                           pb.PushChunksResponse),
            "ResendChunk": (unary, h.resend, pb.ResendChunkRequest, pb.ResendChunkResponse),
            "DeliverChunk": (unary, h.take_delivery, DeliverWire, pb.DeliverChunkResponse),
            "GrantBulk": (unary, h.take_grant, pb.GrantBulkRequest, pb.GrantBulkResponse),
            "OpenBulk": (unary, h.open_bulk, pb.OpenBulkRequest, pb.OpenBulkResponse),
            "AbortRound": (unary, r.abort_round, pb.AbortRoundRequest, pb.AbortRoundResponse),
            "PullState": (grpc.unary_stream_rpc_method_handler, r.pull_state,
                          pb.PullStateRequest, pb.StatePiece),
            "ConfirmPull": (unary, h.confirm_pull, pb.ConfirmPullRequest, pb.ConfirmPullResponse),
        }  # fmt: skip
        return grpc.method_handlers_generic_handler(
            "isthmus.v1.Lane",
            {
                name: kind(
                    handler,
                    request_deserializer=request.FromString,
                    response_serializer=response.SerializeToString,
                )
                for name, (kind, handler, request, response) in calls.items()
            },
        )

    @property
    def address(self) -> str:
        return self._address

    @property
    def members(self) -> Members:
        """The rank's membership: the generation accepted chunks must carry, this site's
        position and the members' names (the one copy on a rank; see :class:`Members`)."""
        return self._members

    @property
    def bulk_port(self) -> int:
        return self.bulk.port if self.bulk is not None else 0

    @property
    def generation(self) -> int:
        return self._members.generation

    @property
    def site_index(self) -> int:
        return self._members.site_index

    def set_members(self, members: Members) -> None:
        """Moves to a new membership; chunks of an older generation are dropped, those of
        the same one stay: a peer that learned the membership first may send its first
        chunks while this rank is still setting up (the lane takes generation-1 chunks
        from the start), and dropping them lost a contribution (a CI run, 2026-11-27:
        step 0 waited out the sync timeout, 121 s)."""
        with self._lock:
            moved = members.generation != self._members.generation
            self._members = members
            if moved:
                self.mailbox.clear()
                self.outbox.clear()
            self._lock.notify_all()

    def _await_generation(self, generation: int, timeout: float) -> None:
        """A sender already in a newer generation may reach this lane a moment before
        its own rank hears of it: hold its chunk briefly rather than refuse it."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._members.generation < generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._lock.wait(left)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops accepting streams; open ones get ``grace`` seconds to finish."""
        self.health.enter_graceful_shutdown()  # NOT_SERVING for every service
        self.offers.clear()
        if self.bulk is not None:
            self.bulk.stop()
        self._server.stop(grace).wait(timeout=(grace or 0) + 5)

    def check(self, req: Chunk) -> str | None:
        """Why ``req`` is not a sound chunk for this lane, or None (also for chunks pulled
        with ``ResendChunk``, which bypass the server)."""
        try:
            validate_chunk(req, self._members, self.codec, self.chunk_bytes)
        except Refused as exc:
            return str(exc)
        return None

    def take(
        self, req: Chunk, holder: str | None | object = ANY_SENDER, peer: str = ""
    ) -> tuple[int, grpc.StatusCode | None, str]:
        """Judges one received chunk and stores it if sound; both transports call it.

        ``holder`` is the site the chunk's ticket or pass was granted to (None: none);
        a sound chunk in another site's name is refused before it can take the real
        one's place, and so is one that failed its checksum (it would mark the real one
        corrupt). :data:`ANY_SENDER`: the sender was checked already (mutual TLS).

        Returns ``(ACCEPTED, None, "")``; ``(CORRUPT, None, why)`` for a chunk whose only
        fault is its checksum (marked: the round pulls it again); or ``(REFUSED, code,
        message)``, and then nothing of the chunk was stored.
        """
        key = (req.step, req.group, req.kind, req.chunk_index, req.from_site)
        try:
            if req.generation > self.generation + _GENERATIONS_AHEAD:
                # Held, it would hold a handler thread for nothing: no sender runs that
                # far ahead of the membership this rank knows.
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"generation {req.generation} is ahead of this lane's {self.generation}",
                )
            if req.generation > self.generation:
                self._await_generation(req.generation, _GENERATION_WAIT_S)
            try:
                validate_chunk(req, self._members, self.codec, self.chunk_bytes)
                self.gate.check_holder(req.from_site, holder, peer)
                why = self.mailbox.deposit(key, req)
            except Refused as exc:
                if not str(exc).startswith(CRC_MISMATCH):
                    raise
                self.gate.check_holder(req.from_site, holder, peer)
                log.warning("site %d: %s from site %d", self.site_index, exc, req.from_site)
                why = self.mailbox.mark_corrupt(key, req.crc32)
                if why is None:
                    with self._lock:
                        self.corruptions += 1
                    return CORRUPT, None, str(exc)
            if why == "again":
                # Sent again after a connection stalled (inter/data/transport/bulk_peer.py): the
                # first copy stands, and the sender hears that this one arrived.
                return ACCEPTED, None, ""
            if why is not None:
                code, text = _MAILBOX_REFUSALS[why]
                box = self.mailbox
                raise Refused(code, text.format(key=key, ahead=box.max_ahead, bytes=box.max_bytes))
        except Refused as exc:
            msg = (
                f"site {self.site_index} refused chunk from site {req.from_site} "
                f"(step {req.step} group {req.group}): {exc}"
            )
            if exc.code != grpc.StatusCode.PERMISSION_DENIED:  # else logged once per caller
                log.warning(msg)
            return REFUSED, exc.code, msg
        return ACCEPTED, None, ""

    def PushChunks(  # noqa: N802 (gRPC method name)
        self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext
    ) -> lane_pb2.PushChunksResponse:
        """Validates and deposits each chunk of the stream as it arrives (holding them to
        the stream's end would deadlock: the sender's results wait for them). A chunk
        whose only fault is its crc32 is marked corrupt (the round pulls it again); any
        other fault aborts the stream, and the refused chunk changes nothing."""
        tls = self.security.require_tls
        holder = ANY_SENDER if tls else self.gate.pass_holder(context)
        # Each peer site may hold its share of the streams, so one that holds streams
        # open (a token holder with a ticket, another site's certificate) cannot take
        # every peer's (issue 33); a stream no peer site holds is not worth a thread.
        caller = self.gate.stream_holder(context, holder)
        share = max(1, self._streams.slots // max(1, self._members.num_sites - 1))
        self._streams.hold_for_stream(context, caller, share)  # or RESOURCE_EXHAUSTED
        accepted = corrupt = 0
        for req in request_iterator:
            if tls:
                self.gate.refuse_unless_sender(context, req.from_site, "PushChunks")
            status, code, msg = self.take(req, holder, context.peer())
            if status == REFUSED:
                context.abort(code, msg)  # raises; nothing of this chunk was stored
            accepted += status == ACCEPTED
            corrupt += status == CORRUPT
        return lane_pb2.PushChunksResponse(accepted=accepted, corrupt=corrupt)
