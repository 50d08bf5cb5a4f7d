"""Lanes: the gRPC data plane between the ranks at one mesh coordinate of every site.

This module owns the receiving side: a :class:`LaneServer` receives ``PushChunks``
streams, validates every message field by field and deposits the valid ones in a
:class:`~isthmus.inter.data.lane.mailbox.Mailbox`; a chunk whose payload fails its crc32 is
marked there instead, and the round pulls it again with ``ResendChunk``; what a lane
hands only to a site of its rounds (a chunk asked for again, a bulk ticket) goes through
:mod:`isthmus.inter.data.lane.handoff`, a round given up and a pull of the training state
through :mod:`isthmus.inter.data.lane.requests`. The limits both sides
share and the checks of a received chunk are :mod:`isthmus.inter.data.transport.chunk_checks`
(re-exported here: :func:`max_payload_bytes`, :func:`channel_options`). The sending side,
:class:`~isthmus.inter.data.lane.peer.LanePeer`, lives in :mod:`isthmus.inter.data.lane.peer`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.bounds import BoundedHealth, RefusalLog, WaitSlots
from isthmus.inter.control.channels import bind_failure, server_options
from isthmus.inter.data.lane.handoff import LaneHandoff, holder_of
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
from isthmus.inter.security import INSECURE, TLS_NAME, SiteSecurity, refuse_unless_named
from isthmus.proto import lane_pb2, lane_pb2_grpc

__all__ = ["LaneServer", "channel_options", "max_payload_bytes"]

log = logging.getLogger(__name__)

_GENERATIONS_AHEAD = 2
"""Generations past this lane's whose chunks it holds for a moment (see ``take``)."""
_GENERATION_WAIT_S = 10.0  # how long a chunk of a newer generation waits for this lane
ANY_SENDER = object()
"""``LaneServer.take``'s holder when the sender was checked already (mutual TLS)."""
PASS_METADATA = "isthmus-lane-pass"
"""gRPC metadata key of the ticket a ``PushChunks`` stream presents without TLS (hex)."""


RESERVED_THREADS = 8
"""A lane's handler threads that ``PushChunks`` streams may never take."""
PULL_STATE_SLOTS = 2 * PULL_STATE_SHARE
"""``PullState`` calls a lane serves at once, each asking site its share
(``PULL_STATE_SHARE``), and only a site the commit admitted, for its check with the
joining rank's lane and its stream: a pull never waits for a state (issue 63). 40 calls
held waiting once took every thread of a lane: its rounds, ``OpenBulk`` and health froze
for 50 s (issue 33, row 3)."""


class LaneServer(lane_pb2_grpc.LaneServicer):
    """The receiving side of one rank's lane.

    Args:
        site_index: this site's index in the membership's site list.
        num_sites: number of sites in the membership.
        codec: codec name every sender must use (``Codec.name``).
        generation: current membership generation.
        chunk_bytes: the job's chunk size; bounds payloads and messages.
        host: interface to bind; port 0 lets the OS pick.
        port: port to bind (0 = ephemeral).
        max_workers: handler threads; each open stream holds one for its round. All
            but :data:`RESERVED_THREADS` may hold ``PushChunks`` streams, so that
            streams nobody ends (issue 14, row 7) never take the threads of
            ``ResendChunk``, ``PullState``, ``OpenBulk`` and health checks.
        security: mutual TLS and the job token (`isthmus.inter.security`); None = off.
        bulk: also take chunks on a TCP port of their own (inter/data/transport/bulk.py), inside
            mutual TLS when the security requires TLS.
        mailbox_bytes: payload bytes received chunks may hold while they wait for their
            round (``Mailbox``); None: unbounded. Give it room for two steps of this
            lane's traffic.
        steps_ahead: how far past the live round a chunk's step may be
            (``Mailbox.max_ahead``): a few steps, times the steps between rounds when
            the job syncs only every so many steps (DiLoCo).
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
        self.codec = codec
        self.chunk_bytes = chunk_bytes
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
        self.handoff = LaneHandoff(self)
        self.requests = LaneRequests(self)
        self._server.add_generic_rpc_handlers((self._handlers(),))
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
        bound = (security or INSECURE).add_port(self._server, f"{host}:{port}")
        if bound == 0:
            where = f"{host}:{port}"
            raise OSError(f"could not bind lane server to {where}: {bind_failure(where)}")
        self._address = f"{host}:{bound}"
        self._bulk: BulkListener | None = None
        if bulk:
            self._bulk = BulkListener(
                host,
                self._take_bulk,
                max_frame=max_payload_bytes(chunk_bytes),
                where=f"lane of site {site_index}",
                refusals=self.refusals,
                tickets=self.tickets,
                tls=server_context(self.security),
                vouch=self._vouches,
            )
        self._server.start()
        log.info("[site %d] lane server listening on %s", site_index, self._address)

    def _handlers(self) -> grpc.GenericRpcHandler:
        """The Lane service with the bulk messages read and written by `inter/data/transport/wire.py`:
        a chunk's payload reaches the handler as a view, not a protobuf copy, and a
        resend goes out as the bytes first sent. PullState is plain protobuf."""
        stream_unary = grpc.stream_unary_rpc_method_handler
        unary_unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            "isthmus.v1.Lane",
            {
                "PushChunks": stream_unary(
                    self.PushChunks,
                    request_deserializer=ChunkWire.FromString,
                    response_serializer=lane_pb2.PushChunksResponse.SerializeToString,
                ),
                "ResendChunk": unary_unary(
                    self.handoff.resend,
                    request_deserializer=lane_pb2.ResendChunkRequest.FromString,
                    response_serializer=lane_pb2.ResendChunkResponse.SerializeToString,
                ),
                "DeliverChunk": unary_unary(
                    self.handoff.take_delivery,
                    request_deserializer=DeliverWire.FromString,
                    response_serializer=lane_pb2.DeliverChunkResponse.SerializeToString,
                ),
                "GrantBulk": unary_unary(
                    self.handoff.take_grant,
                    request_deserializer=lane_pb2.GrantBulkRequest.FromString,
                    response_serializer=lane_pb2.GrantBulkResponse.SerializeToString,
                ),
                "OpenBulk": unary_unary(
                    self.handoff.open_bulk,
                    request_deserializer=lane_pb2.OpenBulkRequest.FromString,
                    response_serializer=lane_pb2.OpenBulkResponse.SerializeToString,
                ),
                "AbortRound": unary_unary(
                    self.requests.abort_round,
                    request_deserializer=lane_pb2.AbortRoundRequest.FromString,
                    response_serializer=lane_pb2.AbortRoundResponse.SerializeToString,
                ),
                "PullState": grpc.unary_stream_rpc_method_handler(
                    self.requests.pull_state,
                    request_deserializer=lane_pb2.PullStateRequest.FromString,
                    response_serializer=lane_pb2.StatePiece.SerializeToString,
                ),
                "ConfirmPull": unary_unary(
                    self.handoff.confirm_pull,
                    request_deserializer=lane_pb2.ConfirmPullRequest.FromString,
                    response_serializer=lane_pb2.ConfirmPullResponse.SerializeToString,
                ),
            },
        )

    @property
    def address(self) -> str:
        """The "host:port" peers dial."""
        return self._address

    @property
    def members(self) -> Members:
        """The rank's membership: the generation accepted chunks must carry, this site's
        position and the members' names (the one copy on a rank; see :class:`Members`)."""
        return self._members

    @property
    def bulk_port(self) -> int:
        """The bulk listener's TCP port; 0 without one."""
        return self._bulk.port if self._bulk is not None else 0

    @property
    def generation(self) -> int:
        """The membership generation accepted chunks must carry."""
        return self._members.generation

    @property
    def site_index(self) -> int:
        """This site's position among the members."""
        return self._members.site_index

    def set_members(self, members: Members) -> None:
        """Moves to a new membership; chunks of an older generation are dropped.

        Within one generation they stay. A peer that learned the membership first may
        send its first chunks while this rank is still setting up, and the lane takes
        generation-1 chunks from the start for that. Dropping them when the rank then
        set its place in the same generation lost a contribution: that round waited out
        the whole sync timeout, and the job went on only after the retry (a CI run,
        2026-11-27: step 0 took 121 s)."""
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
        if self._bulk is not None:
            self._bulk.stop()
        self._server.stop(grace).wait(timeout=(grace or 0) + 5)

    def check(self, req: Chunk) -> str | None:
        """Returns why ``req`` is not a sound chunk for this lane, or None.

        Also for chunks pulled with ``ResendChunk``, which bypass the server.
        """
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

        Returns:
            ``(ACCEPTED, None, "")``; ``(CORRUPT, None, why)`` for a chunk whose only
            fault is its checksum (marked: the round pulls it again); or
            ``(REFUSED, code, message)``, and then nothing of the chunk was stored.
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
                self._check_holder(req.from_site, holder, peer)
                why = self.mailbox.deposit(key, req)
            except Refused as exc:
                if not str(exc).startswith(CRC_MISMATCH):
                    raise
                self._check_holder(req.from_site, holder, peer)
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
            if why == "duplicate":
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"duplicate chunk {key}")
            if why == "stale":
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"chunk {key} belongs to a finished step"
                )
            if why == "ahead":
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"chunk {key} is for a step {self.mailbox.max_ahead} or more past the live one",
                )
            if why == "full":
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"chunk {key}: the mailbox holds its budget of "
                    f"{self.mailbox.max_bytes} bytes of chunks no round has taken",
                )
        except Refused as exc:
            msg = (
                f"site {self.site_index} refused chunk from site {req.from_site} "
                f"(step {req.step} group {req.group}): {exc}"
            )
            if exc.code != grpc.StatusCode.PERMISSION_DENIED:  # else logged once per caller
                log.warning(msg)
            return REFUSED, exc.code, msg
        return ACCEPTED, None, ""

    def _vouches(self, holder: str, names: frozenset[str]) -> bool:
        """Whether a TLS certificate naming ``names`` may carry chunks on a ticket granted
        to ``holder``: only if it names that site, where the membership names sites
        (as :meth:`refuse_unless_sender` checks a gRPC call)."""
        return self._members.site_names is None or holder in names

    def _take_bulk(
        self, req: Chunk, peer: str, holder: str
    ) -> tuple[int, grpc.StatusCode | None, str]:
        """A bulk connection's chunk (its header parsed by the listener), judged like a
        gRPC one; taken only from the site the connection's ticket was granted to."""
        return self.take(req, holder, peer)

    def _check_holder(self, from_site: int, holder: str | None | object, peer: str) -> None:
        """Refuses a chunk "from ``from_site``" unless the ticket or pass it came with
        was granted to that site: an injected chunk is refused before it can take the
        real one's place in the mailbox (issue 33, row 8). Logged once per caller."""
        if holder is ANY_SENDER:
            return
        if holder is None:
            why = f"chunk in site {from_site}'s name without a ticket or pass granted to it"
        elif holder != holder_of(self._members.site_names, from_site):
            why = f"chunk in site {from_site}'s name on a ticket granted to {holder}"
        else:
            return
        self.refusals.note(peer or "a caller", why)
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, why)

    def PushChunks(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: Iterator[Chunk],
        context: grpc.ServicerContext,
    ) -> lane_pb2.PushChunksResponse:
        """Validates and deposits each chunk of the stream; aborts on the first bad one.

        Chunks are deposited one by one as they arrive, not at the end of the stream:
        a round's stream stays open until the sender's results are out, and those wait
        for the chunks already sent (holding them back would deadlock). A chunk whose
        only fault is its crc32 is marked corrupt (the round pulls it again); any other
        fault aborts the stream, and the refused chunk changes nothing.
        """
        tls = self.security.require_tls
        holder = ANY_SENDER if tls else self._pass_holder(context)
        # Each peer site may hold its share of the streams, so one that holds streams
        # open (a token holder with a ticket, another site's certificate) cannot take
        # every peer's (issue 33); a stream no peer site holds is not worth a thread.
        caller = self._stream_holder(context, holder)
        share = max(1, self._streams.slots // max(1, self._members.num_sites - 1))
        self._streams.hold_for_stream(context, caller, share)  # or RESOURCE_EXHAUSTED
        accepted = corrupt = 0
        for req in request_iterator:
            if tls:
                self.refuse_unless_sender(context, req.from_site, "PushChunks")
            status, code, msg = self.take(req, holder, context.peer())
            if status == REFUSED:
                context.abort(code, msg)  # raises; nothing of this chunk was stored
            accepted += status == ACCEPTED
            corrupt += status == CORRUPT
        return lane_pb2.PushChunksResponse(accepted=accepted, corrupt=corrupt)

    def _stream_holder(self, context: grpc.ServicerContext, holder: str | None | object) -> str:
        """The peer site a ``PushChunks`` stream comes from: its certificate's (TLS) or
        its pass's; refused (PERMISSION_DENIED, logged) when that is no peer of this
        lane: no pass, or this very site (it never sends its own lane a chunk)."""
        members = self._members
        own = holder_of(members.site_names, members.site_index)
        if holder is ANY_SENDER:
            names = context.auth_context().get("x509_subject_alternative_name", [])
            named = {n.decode("utf-8", "replace") for n in names}
            peers = named - {own, TLS_NAME}
            if members.site_names is not None:
                peers &= set(members.site_names)
            found = min(peers) if peers else None
            why = f"PushChunks stream whose certificate names no peer site of {own}"
        elif holder is None:
            found, why = None, "PushChunks stream without a ticket or pass granted to a peer"
        else:
            found = holder if holder != own else None
            why = f"PushChunks stream on a pass granted to {own} itself"
        if found is None:
            self.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return f"site {found}"

    def _pass_holder(self, context: grpc.ServicerContext) -> str | None:
        """The site a stream's pass (a ticket in its metadata) was granted to, or None."""
        for key, value in context.invocation_metadata() or ():
            if key == PASS_METADATA and isinstance(value, str) and len(value) <= 128:
                try:
                    return self.tickets.holder(bytes.fromhex(value))
                except ValueError:
                    return None
        return None

    def refuse_unless_sender(
        self, context: grpc.ServicerContext, from_site: int, method: str
    ) -> None:
        """With mutual TLS, a call for site ``from_site`` (a chunk it sends, a chunk sent
        to it) only from a certificate naming that member: another site of the job
        cannot push chunks in its name or pull what was sent to it (issue 14, row 9).
        Called per chunk: without TLS it returns before anything else."""
        if not self.security.require_tls:
            return
        names = self._members.site_names
        if names is not None and from_site < len(names):
            refuse_unless_named(self.security, context, self.where, names[from_site], method)
