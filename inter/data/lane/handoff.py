"""What a lane hands only to a site of its rounds, at the address its rounds know.

Without TLS nothing binds a gRPC caller to a site's name, and an answer goes to
whoever called (issue 33). Two things a lane gives out are therefore never put in an
answer:

* a chunk asked for again (``ResendChunk``): the lane hands it to the asking site's own
  lane in a ``DeliverChunk`` call (rows 7: twenty live gradient chunks once went to a
  caller in site1's name);
* a ticket to its bulk port (``OpenBulk``): granted to the asking site's own lane in a
  ``GrantBulk`` call, and bound to that site, so that a chunk on a connection is taken
  only from the site the ticket was granted to (row 8: chunks injected in a peer's name
  each cost the job a retried step).

Each request carries a nonce the asking lane made (:class:`Handoffs`); the hand-off
carries it back, and the asking lane takes only what answers a nonce of its own. A
stranger never sees a nonce (it goes to the sender's real address only), so it can
neither ask in a site's name and receive, nor hand a site something it did not ask
for. The address a hand-off goes to is the one this lane's rounds talk to
(``Outbox.peers_of``), through the configured proxy as every push goes.

A joining rank's pull of the training state (``PullState``) is answered with the state
itself, so its nonce works the other way round: the serving lane asks the joining
rank's lane, at the address the admitting commit names, whether it made the pull's
nonce (``ConfirmPull``) before it sends a byte (issue 63).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Protocol

import grpc

from isthmus.inter.data.transport.wire import Chunk, Delivery, Frame
from isthmus.inter.security import refuse_unless_named
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.lane.server import LaneServer

__all__ = ["NONCE_BYTES", "HandoffPeer", "Handoffs", "LaneHandoff", "holder_of"]

log = logging.getLogger(__name__)

NONCE_BYTES = 32
MAX_WAITING = 256
"""Nonces a lane keeps at once: a round pulls a few chunks again, a peer's bulk
connections ask for a few tickets; the oldest go first."""
NONCE_TTL_S = 120.0  # a nonce older than this is forgotten: nothing answers that late
_HANDOFF_TIMEOUT_S = 10.0  # one DeliverChunk or GrantBulk call


class HandoffPeer(Protocol):
    """The calls a lane makes to a peer's lane to hand something over (``LanePeer``)."""

    address: str

    def deliver(self, frame: Frame | bytes, nonce: bytes, timeout: float) -> None: ...

    def grant_bulk(self, request: lane_pb2.GrantBulkRequest, timeout: float) -> None: ...


class Handoffs:
    """Nonces this rank made for what it asked of peers, and what came back for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # nonce -> (what was asked, when, what came back or None)
        self._waiting: dict[bytes, tuple[object, float, object]] = {}

    def expect(self, what: object) -> bytes:
        """A new nonce for a request of ``what`` (compared with what comes back)."""
        nonce = os.urandom(NONCE_BYTES)
        now = time.monotonic()
        with self._cond:
            for old in [n for n, v in self._waiting.items() if now - v[1] > NONCE_TTL_S]:
                del self._waiting[old]
            while len(self._waiting) >= MAX_WAITING:
                del self._waiting[next(iter(self._waiting))]
            self._waiting[nonce] = (what, now, None)
        return nonce

    def deliver(self, nonce: bytes, what: object, item: object) -> bool:
        """Takes ``item`` if ``nonce`` is one of ours, asked for ``what`` and not yet
        answered; False otherwise (nothing changes)."""
        with self._cond:
            found = self._waiting.get(nonce)
            if found is None or found[0] != what or found[2] is not None:
                return False
            self._waiting[nonce] = (found[0], found[1], item)
            self._cond.notify_all()
            return True

    def made(self, nonce: bytes, what: object) -> bool:
        """Whether ``nonce`` is one of ours, made for ``what`` (and not forgotten)."""
        with self._cond:
            found = self._waiting.get(nonce)
            return found is not None and found[0] == what

    def forget(self, nonce: bytes) -> None:
        """Forgets ``nonce`` (what it was made for is done)."""
        with self._cond:
            self._waiting.pop(nonce, None)

    def collect(self, nonce: bytes, timeout: float) -> object:
        """What came back for ``nonce`` within ``timeout`` seconds (forgets the nonce),
        or None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._waiting.get(nonce)
                if found is None:
                    return None
                if found[2] is not None or time.monotonic() >= deadline:
                    del self._waiting[nonce]
                    return found[2]
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)


def holder_of(site_names: tuple[str, ...] | None, site: int) -> str:
    """Who a ticket for ``site`` is bound to: its name when the membership names the
    sites (an index moves when a site leaves), else its index."""
    if site_names is not None and site < len(site_names):
        return site_names[site]
    return str(site)


class LaneHandoff:
    """The lane's ``ResendChunk``, ``DeliverChunk``, ``OpenBulk`` and ``GrantBulk``
    handlers (see the module docstring); ``LaneServer`` routes them here."""

    def __init__(self, server: LaneServer) -> None:
        self._server = server

    # -- the sending side answers -----------------------------------------------------

    def resend(
        self, request: lane_pb2.ResendChunkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.ResendChunkResponse:
        """Hands the chunk this site sent to ``request.from_site`` to that site's lane."""
        server = self._server
        server.refuse_unless_sender(context, request.from_site, "ResendChunk")
        generation = server.generation
        key = (request.step, request.group, request.kind, request.chunk_index)
        if request.generation != generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {server.site_index}: generation {request.generation} != {generation}",
            )
        found = server.outbox.get(key, request.from_site)
        if found is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"site {server.site_index} has no chunk {key} for site {request.from_site}",
            )
        assert found is not None  # context.abort raised
        frame, peer = found
        try:
            peer.deliver(frame, request.nonce, _budget(context))
        except grpc.RpcError as exc:
            self._refused_or_failed(
                context, exc, f"ResendChunk of {key} in site {request.from_site}'s name"
            )
        return lane_pb2.ResendChunkResponse()

    def open_bulk(
        self, request: lane_pb2.OpenBulkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.OpenBulkResponse:
        """Grants a ticket to the lane of ``request.from_site`` that asked for it."""
        server = self._server
        members = server.members
        if server.security.require_tls and not server.bulk_port:
            # Under TLS a ticket is only for the bulk port: a PushChunks call is vouched
            # for by its certificate, and needs no pass.
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lane of site {members.site_index} takes chunks on PushChunks only "
                "(mutual TLS is on and it has no bulk port)",
            )
        site = request.from_site
        if site >= members.num_sites or site == members.site_index:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"from_site {site} is not another member of {members.num_sites} sites",
            )
        server.refuse_unless_sender(context, site, "OpenBulk")
        if len(request.nonce) != NONCE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"nonce of {len(request.nonce)} bytes, not {NONCE_BYTES}",
            )
        lanes = server.outbox.peers_of(site)
        if not lanes:
            # This rank's round with that site has not begun: the asker dials again.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"lane of site {members.site_index} has no round with site {site} yet",
            )
        ticket = server.tickets.issue(holder_of(members.site_names, site))
        grant = lane_pb2.GrantBulkRequest(
            nonce=request.nonce, ticket=ticket, port=server.bulk_port, from_site=members.site_index
        )
        failures: list[grpc.RpcError] = []
        for peer in lanes:  # one of them made the nonce (a few lanes between unequal sites)
            try:
                peer.grant_bulk(grant, _budget(context))
                return lane_pb2.OpenBulkResponse(port=server.bulk_port)
            except grpc.RpcError as exc:
                failures.append(exc)
        server.tickets.cancel(ticket)
        what = f"OpenBulk in site {site}'s name"
        if all(_code(exc) == grpc.StatusCode.PERMISSION_DENIED for exc in failures):
            # No lane this rank's rounds met made the nonce: a forged call, or one from a
            # lane of that site whose round with this rank has not begun yet (between
            # sites of unequal sizes a rank meets a site's lanes one round at a time).
            # The asker dials again, as before any round with its site; a forger gets
            # nothing either way. Between unequal sites the line shows once a run.
            self._server.refusals.note(
                context.peer(),
                f"{what} that none of the site's {len(lanes)} lane(s) met so far asked for "
                "(told to dial again: a lane whose round has not begun, or a forged call)",
            )
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: none of the {len(lanes)} lane(s) of site {site} that the rounds of "
                f"site {members.site_index}'s lane met asked for it (yet)",
            )
        # A lane that could not be reached may be the one that asked.
        unreached = next(e for e in failures if _code(e) != grpc.StatusCode.PERMISSION_DENIED)
        self._refused_or_failed(context, unreached, what)
        return lane_pb2.OpenBulkResponse()  # not reached: aborted

    def _refused_or_failed(
        self, context: grpc.ServicerContext, exc: grpc.RpcError, what: str
    ) -> None:
        """The asking site's lane would not take the hand-off: it never asked, so the
        call was forged (logged once per caller, counted); or it could not be reached."""
        code = _code(exc)
        if code == grpc.StatusCode.PERMISSION_DENIED:
            self._server.refusals.note(context.peer(), f"{what} that the site did not ask for")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what}: the site did not ask")
        details = exc.details() if hasattr(exc, "details") else str(exc)
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{what}: could not hand it to the site's lane: {getattr(code, 'name', code)}: "
            f"{details}",
        )

    # -- the asking side takes ----------------------------------------------------------

    def take_delivery(
        self, delivery: Delivery, context: grpc.ServicerContext
    ) -> lane_pb2.DeliverChunkResponse:
        """Takes a chunk this lane's round asked for again (``DeliverChunk``)."""
        server = self._server
        chunk: Chunk = delivery.chunk
        server.refuse_unless_sender(context, chunk.from_site, "DeliverChunk")
        key = (chunk.step, chunk.group, chunk.kind, chunk.chunk_index, chunk.from_site)
        if not server.mailbox.handoffs.deliver(delivery.nonce, ("chunk", key), chunk):
            self._unasked(context, f"DeliverChunk of {key}")
        return lane_pb2.DeliverChunkResponse()

    def take_grant(
        self, request: lane_pb2.GrantBulkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.GrantBulkResponse:
        """Takes a bulk ticket this lane's peer asked for (``GrantBulk``)."""
        server = self._server
        server.refuse_unless_sender(context, request.from_site, "GrantBulk")
        item = (request.port, bytes(request.ticket))
        if not server.mailbox.handoffs.deliver(request.nonce, ("ticket",), item):
            self._unasked(context, f"GrantBulk from site {request.from_site}")
        return lane_pb2.GrantBulkResponse()

    # -- a pull of the training state, confirmed by the pulling rank's lane --------------

    def expect_pull(self, generation: int, step: int, rank: int, source: str) -> bytes:
        """A nonce for this rank's pull of the state after ``step`` in ``generation``
        from rank ``rank`` of site ``source``: valid until :meth:`forget`."""
        return self._server.mailbox.handoffs.expect(_pull(generation, step, rank, source))

    def forget(self, nonce: bytes) -> None:
        """The pull ``nonce`` was made for is over (pulled, or given up)."""
        self._server.mailbox.handoffs.forget(nonce)

    def confirm_pull(
        self, request: lane_pb2.ConfirmPullRequest, context: grpc.ServicerContext
    ) -> lane_pb2.ConfirmPullResponse:
        """Answers a serving lane that asks whether this rank's lane made a pull's nonce
        (``ConfirmPull``); PERMISSION_DENIED when it did not."""
        server = self._server
        refuse_unless_named(server.security, context, server.where, request.source, "ConfirmPull")
        what = _pull(request.generation, request.step, request.rank, request.source)
        if not server.mailbox.handoffs.made(request.nonce, what):
            self._unasked(context, f"ConfirmPull of the state after step {request.step}")
        return lane_pb2.ConfirmPullResponse()

    def _unasked(self, context: grpc.ServicerContext, what: str) -> None:
        self._server.refusals.note(context.peer(), f"{what} for a nonce this lane did not make")
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"lane of site {self._server.site_index} did not ask for it",
        )


def _pull(generation: int, step: int, rank: int, source: str) -> tuple[object, ...]:
    """What a pull's nonce is made for (compared when its serving lane asks)."""
    return ("pull", generation, step, rank, source)


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if hasattr(exc, "code") else None


def _budget(context: grpc.ServicerContext) -> float:
    """Seconds a hand-off may take: the caller's deadline, less a margin for the answer."""
    left = context.time_remaining()
    if left is None:
        return _HANDOFF_TIMEOUT_S
    return max(0.001, min(_HANDOFF_TIMEOUT_S, left - 0.2))
